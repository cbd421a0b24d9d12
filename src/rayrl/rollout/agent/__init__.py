"""Agents: multi-turn episodes of model turns and tool (or environment) answers.

- :mod:`~rayrl.rollout.agent.rollout`: `MultiTurnRollout`, the episodes of a call over
  any engine's request API (the one turn loop), and `multi_turn_metrics`.
- :mod:`~rayrl.rollout.agent.episodes`: `Episodes`, the turn driver (each episode's
  state, its environment steps on worker threads, its token record).
- :mod:`~rayrl.rollout.agent.format`: `TurnFormat`, the chat format of the tokens
  appended for tool answers.
"""
