"""Role workers of a PPO/GRPO run: ActorRolloutRef (hybrid engine), Critic, Reward."""

from rayrl.workers.actor import ActorRolloutRefWorker
from rayrl.workers.critic import CriticWorker
from rayrl.workers.ref import ReferenceWorker
from rayrl.workers.reward import RewardWorker

__all__ = ["ActorRolloutRefWorker", "CriticWorker", "ReferenceWorker", "RewardWorker"]
