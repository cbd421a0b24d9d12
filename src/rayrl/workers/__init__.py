"""Role workers: ActorRolloutRef (hybrid engine), Critic, Reward, Teacher of a PPO/GRPO
run; SFT.

The worker classes are imported on first use, so that a module which needs only a
helper of this package (`rayrl.workers.agent`, read when a config is checked) does not
import every engine.
"""

import importlib
from typing import Any

_WORKERS = {
    "ActorRolloutRefWorker": "rayrl.workers.actor",
    "CriticWorker": "rayrl.workers.critic",
    "ReferenceWorker": "rayrl.workers.ref",
    "RewardWorker": "rayrl.workers.reward",
    "SFTWorker": "rayrl.workers.sft",
    "TeacherWorker": "rayrl.workers.teacher",
}

__all__ = list(_WORKERS)


def __getattr__(name: str) -> Any:
    if name in _WORKERS:
        return getattr(importlib.import_module(_WORKERS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
