"""The Megatron back-end (``pip install 'twinkle-model[megatron]'``): :class:`MegatronModel`, and
:class:`MultiLoraMegatronModel` for many tenants' adapters in shared passes."""

try:
    import megatron.core  # noqa: F401  # the extra's one dependency, checked before anything else imports it
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("twinkle.model.megatron needs megatron-core: pip install 'twinkle-model[megatron]'") from exc

from twinkle.model.megatron.megatron_model import MegatronModel
from twinkle.model.megatron.multi_lora import MultiLoraMegatronModel

__all__ = ["MegatronModel", "MultiLoraMegatronModel"]
