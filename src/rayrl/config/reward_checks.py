"""The checks of the reward's SandboxFusion keys at load (`check_sandbox_fusion`, called
by `rayrl.config.validate`), and of the LLM judge's pool (`check_judge_pool`): ``reward.sandbox_fusion.*`` (verl's names; verl's older
``sandbox_fusion.*`` and ``reward_model.sandbox_fusion.*`` land there).

A URL that is not an HTTP endpoint is refused. A URL that nothing reads is said in a
warning: as in verl, the server scores the built-in code data sources only, so a reward
function of one's own, a reward model or ``reward.http.url`` leaves it unused.
"""

from __future__ import annotations

from collections.abc import Callable

from rayrl.config.errors import ConfigError
from rayrl.config.schema import RayRLConfig

__all__ = ["check_judge_pool", "check_sandbox_fusion"]

KEY = "reward.sandbox_fusion.url"


def check_sandbox_fusion(cfg: RayRLConfig, warn: Callable[[str], None]) -> None:
    url = cfg.reward.sandbox_fusion.url
    if url is None:
        return
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(
            f"{KEY}={url!r} must be a SandboxFusion run_code endpoint starting with http:// "
            "or https:// (e.g. http://localhost:8080/run_code), or null"
        )
    fn = cfg.custom_reward_function
    if cfg.reward_model.enable:
        instead = "the reward model (reward_model.enable=true) scores every sample"
    elif cfg.reward.http.url:
        instead = f"the reward service reward.http.url={cfg.reward.http.url} scores every sample"
    elif fn.path or fn.pickled:
        instead = (
            "your reward function scores every sample (as in verl, the server serves the "
            "built-in scorers of codecontests, apps, codeforces and taco only; call it from "
            "your compute_score if you need it there)"
        )
    else:
        return
    warn(f"{KEY}={url} has no effect: {instead}")


def check_judge_pool(cfg: RayRLConfig) -> None:
    """An LLM judge on a pool of its own (`reward_model.enable_resource_pool`) needs a
    pool of at least one replica: verl's `nnodes` default 0 means none."""
    from rayrl.config.judge_mode import judge_on_own_pool

    rm = cfg.reward_model
    if judge_on_own_pool(cfg) and (rm.nnodes < 1 or rm.n_gpus_per_node < 1):
        raise ConfigError(
            f"reward_model.enable_resource_pool=true needs reward_model.nnodes >= 1 and "
            f"reward_model.n_gpus_per_node >= 1 (got {rm.nnodes} and {rm.n_gpus_per_node}): "
            "the judge's pool has n_gpus_per_node replicas on each of nnodes nodes"
        )
