"""Twinkle patches: reversible fixes to third-party models and chat templates.

``apply_patch(target, patch)`` applies a :class:`twinkle.interfaces.Patch`
(an instance, a class, or a registered / entry-point name) and
``remove_patch(target, patch)`` undoes it exactly; ``with patched(target,
*patches):`` scopes them. Models and samplers take ``patches=[...]`` and
``kernels=...``: :func:`accelerate` is what they do with them.
"""

from twinkle.patch.accelerate import KernelsSpec, accelerate
from twinkle.patch.apply import PatchSpec, applied_patches, apply_patch, patched, remove_patch
from twinkle.patch.fused_logps import FusedLinearLogpsPatch
from twinkle.patch.megatron_autocast import MegatronAutocastPatch
from twinkle.patch.qwen3_template import Qwen3ThinkingTemplatePatch

__all__ = [
    "FusedLinearLogpsPatch",
    "KernelsSpec",
    "MegatronAutocastPatch",
    "PatchSpec",
    "Qwen3ThinkingTemplatePatch",
    "accelerate",
    "applied_patches",
    "apply_patch",
    "patched",
    "remove_patch",
]
