"""Write docs/config-reference.md from the config schema.

    .venv/bin/python scripts/config_reference.py          # rewrite docs/config-reference.md
    .venv/bin/python scripts/config_reference.py --check  # exit 1 if the file is stale

Every key of `rayrl train`'s schema (`rayrl.config.schema.RayRLConfig`), of `rayrl
sft`'s (`rayrl.config.sft.SFTConfig`) and of `rayrl rm` / `rayrl dpo`'s
(`rayrl.config.pref.PrefConfig`), one table row each: its type, its default (the
schema's; `${key}` follows another key), its range (`rayrl.config.ranges.RANGES` and the
choices of `rayrl.config.validate`), verl's name for it, the built-in configs that set
it (`-c NAME`), and what it does (the comment beside the field in the schema, else the
note of its range, else the modules under src/rayrl that read it).

verl's name: "same" where verl 0.9.1's generated config has the key under that name
(tests/data/verl_0.9.1_*_keys.jsonl), plus every other spelling that
`rayrl.config.compat` moves onto it; "-" for rayrl's own keys.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import json
import re
import sys
import tokenize
import typing
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from rayrl.algos.preference import PREFERENCE_LOSSES  # noqa: E402
from rayrl.config.compat import Moved, verl_ppo, verl_sft  # noqa: E402
from rayrl.config.pref import PREF_POSITIVE, PrefConfig  # noqa: E402
from rayrl.config.ranges import RANGES  # noqa: E402
from rayrl.config.schema import RayRLConfig  # noqa: E402
from rayrl.config.sft import SFT_CHOICES, SFT_POSITIVE, SFTConfig  # noqa: E402
from rayrl.config.validate import CHOICES  # noqa: E402

OUT = ROOT / "docs" / "config-reference.md"
DATA = ROOT / "tests" / "data"
CONFIG_DIR = ROOT / "src" / "rayrl" / "config"
SRC = ROOT / "src" / "rayrl"
COMMAND = ".venv/bin/python scripts/config_reference.py"


# -- what the schema's source says about each field -------------------------------------


def _comments(path: str) -> dict[int, str]:
    """Line number -> the text of the comment on that line."""
    out: dict[int, str] = {}
    source = Path(path).read_text()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def _clean(text: str) -> str:
    text = re.sub(r"type: ignore\[[a-z-]+\]\s*(#\s*)?", "", text)
    text = re.sub(r"noqa: [A-Z0-9]+[^#]*", "", text)
    return " ".join(text.split()).strip(" #")


_FIELD_NOTES: dict[type, dict[str, str]] = {}


def field_notes(cls: type) -> dict[str, str]:
    """Field name -> its comment in the class body: the comment at the end of its line,
    else the block of comment lines right above it."""
    if cls in _FIELD_NOTES:
        return _FIELD_NOTES[cls]
    path = inspect.getsourcefile(cls)
    lines, start = inspect.getsourcelines(cls)
    comments = _comments(path)
    tree = ast.parse(inspect.cleandoc("\n".join(line.rstrip("\n") for line in lines)))
    node = tree.body[0]
    assert isinstance(node, ast.ClassDef)
    out: dict[str, str] = {}
    for stmt in node.body:
        if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
            continue
        first = start + stmt.lineno - 1
        last = start + stmt.end_lineno - 1
        trailing = " ".join(comments[n] for n in range(first, last + 1) if n in comments)
        above: list[str] = []
        n = first - 1
        while n in comments and lines[n - start].strip().startswith("#"):
            above.insert(0, comments[n])
            n -= 1
        text = _clean(trailing) or _clean(" ".join(above))
        if text:
            out[stmt.target.id] = text
    _FIELD_NOTES[cls] = out
    return out


def _doc(cls: type) -> str:
    doc = cls.__dict__.get("__doc__") or ""
    if doc.startswith(cls.__name__ + "("):  # the dataclass's generated signature
        return ""
    return " ".join(doc.split())


# -- the walk ---------------------------------------------------------------------------


def _type_name(tp: typing.Any) -> str:
    if isinstance(tp, str):
        return tp
    text = getattr(tp, "__name__", None) if not typing.get_args(tp) else None
    text = text or str(tp).replace("typing.", "")
    text = text.replace("NoneType", "None").replace("Any", "any")
    # a free-form mapping or list (typed `dict[Any, Any]` for mypy) reads as plain dict/list
    return text.replace("dict[any, any]", "dict").replace("list[any]", "list")


def _default(f) -> typing.Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def walk(cls: type, prefix: str = ""):
    """A group's leaves, then its subgroups: ("group", path, class, None) before each
    group's keys, ("key", path, (field, type, default), owner class) for each key."""
    hints = typing.get_type_hints(cls)
    groups = []
    for f in fields(cls):
        path = f"{prefix}{f.name}"
        default = _default(f)
        if is_dataclass(default):
            groups.append((path, type(default)))
        else:
            yield ("key", path, (f, hints.get(f.name, f.type), default), cls)
    for path, sub in groups:
        yield ("group", path, sub, None)
        yield from walk(sub, path + ".")


def _shown(value: typing.Any) -> str:
    if isinstance(value, str):
        follows = re.fullmatch(r"\$\{([^}]+)\}", value)
        if follows:
            return f"follows `{follows.group(1)}`"
        return f"`{value}`"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, dict | list):
        return f"`{json.dumps(value)}`"
    return f"`{value}`"


def _relative_follow(path: str, value: typing.Any) -> typing.Any:
    """`${.key}` (a sibling) spelled out as the full key."""
    if isinstance(value, str) and value.startswith("${."):
        return "${" + path.rsplit(".", 1)[0] + "." + value[3:]
    return value


# -- verl's names ------------------------------------------------------------------------


def _verl_keys(name: str | None) -> set[str]:
    if name is None:  # a command verl has no config for
        return set()
    with (DATA / name).open() as fh:
        return {json.loads(line)["key"] for line in fh if line.strip()}


def verl_names(rules: dict, verl_keys: set[str]) -> typing.Callable[[str], str]:
    moved = [(pattern, rule.target) for pattern, rule in rules.items() if isinstance(rule, Moved)]

    def name(path: str) -> str:
        names = ["same"] if path in verl_keys else []
        for pattern, target in sorted(moved):
            if pattern == path:
                continue
            if path == target:
                names.append(f"`{pattern}`")
            elif path.startswith(target + "."):
                names.append(f"`{pattern}{path[len(target) :]}`")
        return ", ".join(names) or "-"

    return name


# -- built-in configs and readers ----------------------------------------------------------


def _flat(data: dict, prefix: str = "") -> dict[str, typing.Any]:
    out: dict[str, typing.Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def builtins(*directories: Path, label: bool = False) -> dict[str, dict[str, typing.Any]]:
    """Built-in config name -> its keys and values (flattened); with ``label``, each
    name is prefixed by its directory's (the command's) name."""
    return {
        (f"{d.name} {p.stem}" if label else p.stem): _flat(yaml.safe_load(p.read_text()) or {})
        for d in directories
        for p in sorted(d.glob("*.yaml"))
    }


_SOURCES: list[tuple[str, str]] = []


def readers(path: str) -> str:
    """The modules under src/rayrl (outside config/) whose text names the key's last two
    parts (`optim.lr`, `trainer.seed`)."""
    if not _SOURCES:
        for p in sorted(SRC.rglob("*.py")):
            rel = p.relative_to(SRC.parent).as_posix()
            if not rel.startswith("rayrl/config/"):
                _SOURCES.append((rel, p.read_text()))
    tail = ".".join(path.split(".")[-2:])
    pattern = re.compile(r"\b" + re.escape(tail) + r"\b")
    found = [rel for rel, text in _SOURCES if pattern.search(text)]
    if not found:
        return ""
    more = f" and {len(found) - 2} more" if len(found) > 2 else ""
    return "read in " + ", ".join(f"`{f}`" for f in found[:2]) + more


# What a key does, for the keys the schema has no comment on (or one comment for
# several keys). A whole key comes before the schema's comment; then the comment; then
# the key's last two parts, then its last part.
NOTES: dict[str, str] = {
    # data
    "data.val_files": "validation files: a path or a list; empty: no validation (the "
    "synthetic task's held-out split when train_files is empty too)",
    "data.prompt_key": "the column that holds the chat messages of each prompt",
    "data.max_prompt_length": "prompt tokens; longer prompts follow data.truncation",
    "data.max_response_length": "tokens generated per response (per episode with agents)",
    "data.filter_overlong_prompts": "set prompts over max_prompt_length aside at load",
    "data.shuffle": "reshuffle the training rows every epoch (seeded)",
    "data.dataloader_num_workers": "Ray Data loader's read parallelism (data.loader=ray)",
    "synthetic_size": "rows of the synthetic task (when train_files is empty)",
    "data.val_max_samples": "-1: every validation row",
    "response_key": "the column that holds each response",
    "response_dict_keys": "keys into a nested response column, outermost first",
    "apply_chat_template_kwargs": "extra arguments of the chat template",
    "multiturn.enable": "rows hold whole conversations; the loss covers assistant messages",
    "multiturn.messages_key": "the column of chat messages (multi-turn SFT)",
    "multiturn.tools_key": "the column of tool schemas (multi-turn SFT)",
    # models
    "trust_remote_code": "let transformers run the model directory's own code",
    "attn_implementation": "transformers' attention (sdpa, eager, flash_attention_2)",
    "enable_gradient_checkpointing": "recompute activations in the backward pass",
    "lora_alpha": "LoRA's scale numerator (with lora_rank > 0)",
    "target_modules": '"all-linear" or a list of module names that get LoRA adapters',
    "critic.model.tokenizer_path": "defaults to the critic's model path",
    "critic.model.use_remove_padding": "sequence packing for the critic",
    "critic.model.share_prompts": "as actor_rollout_ref.model.share_prompts, for the critic",
    "param_offload": "keep the parameters in host memory between uses",
    "optimizer_offload": "keep the optimizer state in host memory; the offloaded Adam step "
    "runs a slice of parameters at a time",
    "offload_params": "keep the parameters in host memory between uses",
    "actor_rollout_ref.ref.fsdp_config.dtype": "compute dtype on GPU: bfloat16 | float32",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "native engine: the GPU share for "
    "weights and KV cache",
    "actor_rollout_ref.rollout.max_model_len": "native engine: the longest prompt + "
    "response; null: data.max_prompt_length + data.max_response_length",
    # optimizers
    "lr": "the learning rate",
    "betas": "AdamW's betas",
    "eps": "AdamW's epsilon",
    "weight_decay": "AdamW's decoupled weight decay",
    "lr_warmup_steps_ratio": "the share of the steps that warms up (lr_warmup_steps < 0)",
    "min_lr_ratio": "the cosine schedule's floor, a share of lr",
    "num_cycles": "cosine cycles over the run (0.5: one half-cosine decay)",
    "clip_grad": "the gradient norm clip; 0 disables",
    # the actor, rollout and reference
    "use_dynamic_bsz": "size micro-batches by a token budget instead of a row count",
    "loss_agg_mode": "how token losses become one loss: token-mean, seq-mean-token-sum, "
    "seq-mean-token-mean, seq-mean-token-sum-norm",
    "use_kl_loss": "a KL term against the reference in the loss (GRPO's way)",
    "kl_loss_type": "the KL estimator of the loss (kl, abs, mse, low_var_kl, full)",
    "rollout.do_sample": "false decodes greedily",
    "val_kwargs.do_sample": "false decodes greedily (validation)",
    "log_prob_micro_batch_size_per_gpu": "samples per forward pass of the log-prob pass",
    "log_prob_use_dynamic_bsz": "log-prob micro-batches by a token budget",
    "log_prob_max_token_len_per_gpu": "the token budget of a log-prob micro-batch (dynamic)",
    "max_num_seqs": "native engine: batch slots (sequences decoded at once)",
    "max_num_batched_tokens": "native engine: prompt tokens per prefill step",
    "enforce_eager": "native engine: no CUDA graphs",
    "free_cache_engine": "native engine: release the KV cache between generations",
    "ref.use_torch_compile": "as the actor's use_torch_compile, for the reference",
    "ref.ulysses_sequence_parallel_size": "as the actor's, for the reference's passes",
    # agents
    "multi_turn.enable": "each sample is an episode of model turns and tool answers",
    "max_assistant_turns": "model turns per episode; null: no limit",
    "tool_config_path": "verl's tool YAML (a tools: list of class_name, config, tool_schema)",
    "function_tool_path": "a Python file whose rayrl.envs.function_tool objects are tools",
    "interaction_config_path": "verl's interaction YAML: a simulated user",
    "max_user_turns": "simulated-user turns per episode; null: no limit",
    "max_parallel_calls": "tool calls run per assistant turn",
    "max_tool_response_length": "tokens of each tool response",
    "tool_response_truncate_side": "where a long tool response is cut: left | middle | right",
    "tokenization_sanity_check_mode": "strict | ignore_strippable: check every step that "
    "the trained tokens are the rollout's; disable: skip the check",
    "multi_turn.format": "the tool-call format: hermes (alias qwen, qwen25) | gpt-oss",
    "tool_timeout_s": "a tool call's timeout, unless the tool sets its own",
    "env_timeout_s": "a whole environment step's timeout",
    "max_concurrent_tools": "tool calls running at once, per worker",
    "stop_at_tool_call_end": "end a turn at the first complete tool call",
    "environment_config": "settings handed to every environment",
    "default_agent_loop": "the environment of rows without an agent_name column "
    "(tool_agent runs tools)",
    # the critic
    "critic.ppo_mini_batch_size": "prompts per critic mini-batch (times rollout.n samples)",
    "critic.ppo_micro_batch_size_per_gpu": "samples per critic forward/backward",
    "critic.forward_micro_batch_size_per_gpu": "samples per forward pass of the value pass",
    "critic.forward_micro_batch_size": "verl's deprecated size for all GPUs together",
    "critic.ppo_max_token_len_per_gpu": "token budget of a critic micro-batch (dynamic)",
    "critic.forward_max_token_len_per_gpu": "token budget of a value-pass micro-batch",
    "critic.ppo_epochs": "passes over each step's samples",
    "critic.shuffle": "reshuffle the rows before each epoch's mini-batches",
    "critic.ulysses_sequence_parallel_size": "ranks that split each packed row (Ulysses)",
    # rewards
    "reward_model.enable": "score with a reward model (reward_model.model.path)",
    "overlong_buffer.penalty_factor": "the penalty at max_response_length",
    "custom_reward_function.name": "the function's name in the file",
    "reward_manager.name": "naive | prime | dapo | batch",
    "http.url": "a reward service: one POST per batch (docs/rewards.md)",
    "http.timeout_s": "seconds per HTTP attempt",
    "http.retries": "retries of a failed call, with a doubling back-off",
    # the algorithm
    "adv_estimator": "gae, grpo, dr_grpo, rloo, reinforce_plus_plus, "
    "reinforce_plus_plus_baseline, remax, gpg",
    "norm_adv_by_std_in_grpo": "divide GRPO's advantages by the group's standard deviation",
    "use_kl_in_reward": "a KL penalty in the reward (kl_ctrl sets its coefficient)",
    "kl_penalty": "the KL estimator of the reward penalty (kl, abs, mse, low_var_kl, full)",
    "kl_ctrl.horizon": "the adaptive controller's horizon (steps)",
    "kl_ctrl.target_kl": "the adaptive controller's target KL",
    "rollout_is_threshold": "the cap of the truncated importance weights",
    "rollout_correction.loss_type": "bypass mode's loss: ppo_clip | reinforce",
    # the trainer
    "nnodes": "machines of the pool",
    "trainer.seed": "the seed of every random draw (data order, sampling, dropout)",
    "total_epochs": "passes over the training data (unless total_training_steps is set)",
    "project_name": "the tracker's project; part of the default output_dir",
    "experiment_name": "the tracker's run name; part of the default output_dir",
    "resume_from_path": "a checkpoints/global_step_N directory (resume_mode=resume_path)",
    "save_freq": "steps between checkpoints; -1: only at the end",
    "test_freq": "steps between validations; -1: never",
    "val_before_train": "validate the starting model before the first step",
    "max_actor_ckpt_to_keep": "newest checkpoints kept; null: all",
    "max_critic_ckpt_to_keep": "newest critic checkpoints kept; null: all",
    "max_ckpt_to_keep": "newest checkpoints kept; null: all",
    "logger": "trackers: console, jsonl, tensorboard, wandb, mlflow, swanlab, file",
    "log_worker_output": "worker prints reach the driver, prefixed role/rank",
    "trainer.debug": "Ray distributed debugger: breakpoint() in workers, post-mortem",
    "trainer.debugger": "vscode (debugpy, the VS Code extension) | cli (`ray debug`)",
    # resources
    "capacity_factor": "spare bundles for replacing lost workers (1.25: one per 4)",
    "init_timeout_s": "seconds a replacement worker may take to initialise",
    "init_retries": "tries to start a replacement worker again",
    "loader_workers": "CPUs each worker uses for data loading, for the over-subscription warning",
    "rollout.cpus_per_replica": "CPUs of each replica's bundle",
    "dashboard_port": "the Ray dashboard's port when rayrl starts Ray (the next free one "
    "above is taken)",
}


def note(path: str) -> str:
    parts = path.split(".")
    for key in (path, ".".join(parts[-2:]), parts[-1]):
        if key in NOTES:
            return NOTES[key]
    return ""


# -- the page ------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _range(path: str, ranges: dict, choices: dict, positive: tuple = ()) -> str:
    parts = []
    if path in ranges:
        parts.append(ranges[path].describe())
    if path in positive:
        parts.append(">= 1")
    if path in choices:
        parts.append(
            "one of " + ", ".join(f"`{'null' if c is None else c}`" for c in choices[path])
        )
    return "; ".join(parts)


def section(
    title: str,
    schema: type,
    rules: dict,
    verl_file: str | None,
    configs: dict[str, dict[str, typing.Any]],
    ranges: dict,
    choices: dict,
    positive: tuple = (),
) -> tuple[list[str], list[str]]:
    """The markdown of one schema, and its keys."""
    verl = verl_names(rules, _verl_keys(verl_file))
    lines = [f"## {title}", ""]
    keys: list[str] = []
    for kind, path, info, owner in walk(schema):
        if kind == "group":
            doc = _doc(info)
            lines += ["", f"### `{path}`", ""]
            if doc:
                lines += [doc, ""]
            lines += [
                "| key | type | default | range | verl | built-in configs | what it does |",
                "|---|---|---|---|---|---|---|",
            ]
            continue
        f, tp, default = info
        keys.append(path)
        if not lines[-1].startswith("|"):  # top-level keys, before any group
            lines += [
                "| key | type | default | range | verl | built-in configs | what it does |",
                "|---|---|---|---|---|---|---|",
            ]
        what = NOTES.get(path) or field_notes(owner).get(f.name, "") or note(path)
        if not what and path in ranges and ranges[path].note:
            what = ranges[path].note
        if not what:
            what = readers(path)
        set_by = ", ".join(
            f"{name}: {_shown(values[path])}" for name, values in configs.items() if path in values
        )
        row = [
            f"`{path}`",
            _type_name(tp),
            _shown(_relative_follow(path, default)),
            _range(path, ranges, choices, positive),
            verl(path),
            set_by,
            what,
        ]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return lines, keys


HEADER = f"""# Config reference

<!-- generated by `{COMMAND}` from the schema: do not edit by hand -->

Every key of `rayrl train`, `rayrl sft`, and `rayrl rm` / `rayrl dpo`, generated from the
schema (`src/rayrl/config/schema.py`, `src/rayrl/config/sft.py`, `src/rayrl/config/pref.py`
and the modules they import).
A test (`tests/test_config_reference.py`) fails when this page and the schema differ;
run `{COMMAND}` to write it again.

- **default**: what a key is when nothing sets it. "follows `KEY`" means it takes that
  key's value unless set. The schema's defaults are verl's, sized for 8 GPUs; the
  built-in configs (`-c grpo`, `-c ppo`, `-c demo`, `-c demo_tools`; `rayrl sft -c demo`;
  `rayrl rm -c demo`, `rayrl dpo -c demo`)
  hold small values for one CPU or GPU.
- **range**: checked when the config loads; a value outside it stops the command
  with a `config error` naming the key (exit code 2).
- **verl**: `same` where verl 0.9.1's config has the key under this name; other names
  verl uses for it (moved onto this key when they appear); `-` for rayrl's own keys.
- **what it does**: the schema's comment for the key, else the note of its range, else
  the modules that read it.

Set any key on the command line as `group.key=value` (values are YAML), or in a YAML
file given with `-c FILE`. `rayrl config show [-c NAME] [KEY=VALUE ...]` prints the
resolved config.
"""


def render() -> tuple[str, list[str]]:
    train, train_keys = section(
        "`rayrl train`",
        RayRLConfig,
        verl_ppo.RULES,
        "verl_0.9.1_ppo_keys.jsonl",
        builtins(CONFIG_DIR),
        RANGES,
        CHOICES,
    )
    sft, sft_keys = section(
        "`rayrl sft`",
        SFTConfig,
        verl_sft.RULES,
        "verl_0.9.1_sft_keys.jsonl",
        builtins(CONFIG_DIR / "sft"),
        {},
        SFT_CHOICES,
        SFT_POSITIVE,
    )
    pref, pref_keys = section(
        "`rayrl rm` and `rayrl dpo`",
        PrefConfig,
        {},
        None,  # verl has no preference trainer
        builtins(CONFIG_DIR / "rm", CONFIG_DIR / "dpo", label=True),
        {},
        {"objective.name": sorted(PREFERENCE_LOSSES.names())},
        PREF_POSITIVE,
    )
    parts = ["\n".join(train), "\n".join(sft), "\n".join(pref)]
    text = HEADER + "\n" + "\n\n".join(parts) + "\n"
    text = re.sub(r"\n{3,}", "\n\n", text)
    keys = [f"train: {k}" for k in train_keys] + [f"sft: {k}" for k in sft_keys]
    keys += [f"pref: {k}" for k in pref_keys]
    return text, keys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    text, _ = render()
    if args.check:
        if not args.out.is_file() or args.out.read_text() != text:
            print(f"{args.out} differs from the schema: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
