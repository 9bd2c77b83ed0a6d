"""Small helpers shared by every Twinkle package (logging, seeding, optional imports)."""

from twinkle.utils.adapters import pick_adapter
from twinkle.utils.imports import require
from twinkle.utils.logging import get_logger
from twinkle.utils.seed import seed_everything

__all__ = ["get_logger", "pick_adapter", "require", "seed_everything"]
