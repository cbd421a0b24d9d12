"""Role workers: ActorRolloutRef (hybrid engine), Critic, Reward of a PPO/GRPO run; SFT."""

from rayrl.workers.actor import ActorRolloutRefWorker
from rayrl.workers.critic import CriticWorker
from rayrl.workers.ref import ReferenceWorker
from rayrl.workers.reward import RewardWorker
from rayrl.workers.sft import SFTWorker

__all__ = ["ActorRolloutRefWorker", "CriticWorker", "ReferenceWorker", "RewardWorker", "SFTWorker"]
