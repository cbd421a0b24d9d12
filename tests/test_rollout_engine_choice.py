"""`rollout.name=auto` (the default, and verl's vllm/sglang names): the engine it picks
on each device for each model, and the options it passes, the same as the explicit name's."""

from __future__ import annotations

from native_toys import gpt2_config


def _pick(name: str, device_type: str, model_config) -> str:
    from rayrl.config.load import load_config
    from rayrl.rollout import resolve_rollout

    cfg = load_config(None, [f"actor_rollout_ref.rollout.name={name}"], validate=False)
    return resolve_rollout(cfg.actor_rollout_ref.rollout, cfg.data, device_type, model_config).name


def test_auto_picks_native_on_a_gpu_for_the_models_it_runs():
    """`rollout.name=auto` (the default, and verl's vllm/sglang): native on CUDA for a
    model the native engine runs, hf on a CPU, for other models or for a Qwen2 with a
    feature the engine lacks (sliding windows); a named engine stays named."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    from rayrl.config.load import load_config
    from rayrl.rollout import AUTO

    assert load_config(None, [], validate=False).actor_rollout_ref.rollout.name == AUTO
    for config in (Qwen2Config(), Qwen3Config(), LlamaConfig()):
        assert _pick(AUTO, "cuda", config) == "native"
        assert _pick(AUTO, "cpu", config) == "hf"
    assert _pick(AUTO, "cuda", gpt2_config()) == "hf"
    assert _pick(AUTO, "cuda", Qwen2Config(use_sliding_window=True)) == "hf"
    assert _pick("hf", "cuda", Qwen2Config()) == "hf"
    assert _pick("native", "cpu", gpt2_config()) == "native"


def test_auto_takes_the_native_engines_options_as_the_explicit_name_does():
    """A default must take the same path as the explicit setting: under
    `rollout.name=auto` resolved to native, the native engine's keys from the config
    (`gpu_memory_utilization`, `max_num_seqs`, ...) reach the engine exactly as under
    `rollout.name=native` (they were silently dropped unless the config said native)."""
    from transformers import Qwen2Config

    from rayrl.config.load import load_config
    from rayrl.rollout import resolve_rollout

    keys = [
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.37",
        "actor_rollout_ref.rollout.max_num_seqs=17",
        "actor_rollout_ref.rollout.max_num_batched_tokens=1234",
        "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.enable_prefix_caching=false",
        "data.max_prompt_length=40",
        "data.max_response_length=24",
    ]
    choices = {}
    for name in ("auto", "native"):
        cfg = load_config(None, [f"actor_rollout_ref.rollout.name={name}", *keys], validate=False)
        r = cfg.actor_rollout_ref.rollout
        choices[name] = resolve_rollout(r, cfg.data, "cuda", Qwen2Config())
    assert choices["auto"].name == choices["native"].name == "native"
    assert "auto on cuda: native" in choices["auto"].reason
    assert (
        choices["auto"].options
        == choices["native"].options
        == {
            "gpu_memory_utilization": 0.37,
            "enable_prefix_caching": False,
            "max_num_seqs": 17,
            "max_num_batched_tokens": 1234,
            "enforce_eager": True,
            "max_model_len": 64,
            "record_routes": False,  # routing replay's record (off: no R3)
            "quantization": None,  # rollout.quantization (fp8: the FP8 rollout)
        }
    )
    cfg = load_config(None, ["actor_rollout_ref.rollout.name=auto", *keys], validate=False)
    hf = resolve_rollout(cfg.actor_rollout_ref.rollout, cfg.data, "cpu", Qwen2Config())
    assert (hf.name, hf.options) == ("hf", {})
