"""``DPOMetric``: preference accuracy and reward margins of DPO-style training."""

from __future__ import annotations

from collections.abc import Sequence

from twinkle.interfaces import Metric
from twinkle.metric.arrays import finite_vector, same_length
from twinkle.registry import register


@register("metric")
class DPOMetric(Metric):
    """Statistics of the implicit rewards ``beta * (log pi(y|x) - log pi_ref(y|x))`` of chosen/rejected pairs.

    ``calculate()`` returns, over the pairs seen since ``reset`` (``{}`` before any):

    * ``dpo/accuracy``: fraction of pairs with ``chosen > rejected`` (a tie counts as wrong);
    * ``dpo/margin``: mean of ``chosen - rejected``;
    * ``dpo/chosen_reward``, ``dpo/rejected_reward``: the means of each side;
    * ``dpo/num_pairs``.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._num_pairs = 0
        self._num_correct = 0
        self._chosen_sum = 0.0
        self._rejected_sum = 0.0

    def accumulate(self, chosen_rewards: Sequence[float], rejected_rewards: Sequence[float]) -> None:
        """Add one batch of pairs: ``chosen_rewards[i]`` and ``rejected_rewards[i]`` belong to pair ``i``."""
        chosen = finite_vector(chosen_rewards, "chosen_rewards")
        rejected = finite_vector(rejected_rewards, "rejected_rewards")
        same_length(chosen, rejected, "chosen_rewards", "rejected_rewards")
        self._num_pairs += chosen.size
        self._num_correct += int((chosen > rejected).sum())
        self._chosen_sum += float(chosen.sum())
        self._rejected_sum += float(rejected.sum())

    def calculate(self) -> dict[str, float]:
        if not self._num_pairs:
            return {}
        chosen, rejected = self._chosen_sum / self._num_pairs, self._rejected_sum / self._num_pairs
        return {
            "dpo/accuracy": self._num_correct / self._num_pairs,
            "dpo/margin": chosen - rejected,
            "dpo/chosen_reward": chosen,
            "dpo/rejected_reward": rejected,
            "dpo/num_pairs": float(self._num_pairs),
        }
