"""Metrics: accumulate values over steps, report scalars (``twinkle.interfaces.Metric``).

Every class is registered under its class name (entry-point group
``twinkle.metric``), so ``model.add_metric('DPOMetric')`` works without
importing this package. Inputs may be lists, numpy arrays or CPU tensors; only
numpy is needed, so a torch-free client can report rollout statistics.
"""

from twinkle.metric.completion_reward import CompletionRewardMetric
from twinkle.metric.dpo import DPOMetric
from twinkle.metric.logprob_mismatch import LogprobMismatchMetric
from twinkle.metric.policy import PolicyMetric

__all__ = ["CompletionRewardMetric", "DPOMetric", "LogprobMismatchMetric", "PolicyMetric"]
