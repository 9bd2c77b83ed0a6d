"""Data formats shared by every Twinkle component.

Rows (``Message``, ``Trajectory``, ``InputFeature``) are plain dicts described by
``TypedDict`` and checked by ``validate_*`` functions; call results
(``SamplingParams``, ``SampleResponse``, ``ModelOutput``, ...) are dataclasses
with ``to_dict``/``from_dict``.
"""

from twinkle.data_format.input_feature import (
    FREE_EXPERT,
    IGNORE_INDEX,
    TOKEN_FIELDS,
    InputFeature,
    check_binary,
    make_input_feature,
    unshifted_labels,
    validate_input_feature,
)
from twinkle.data_format.message import (
    FunctionToolCall,
    Message,
    Tool,
    ToolCall,
    Trajectory,
    validate_message,
    validate_trajectory,
)
from twinkle.data_format.output import LossOutput, ModelOutput
from twinkle.data_format.sampling import (
    SampleCall,
    SampledSequence,
    SampleResponse,
    SampleResult,
    SamplingParams,
    StopReason,
    prompt_major,
)
from twinkle.data_format.serde import Serializable

__all__ = [
    "FREE_EXPERT",
    "IGNORE_INDEX",
    "TOKEN_FIELDS",
    "FunctionToolCall",
    "InputFeature",
    "LossOutput",
    "Message",
    "ModelOutput",
    "SampleCall",
    "SampleResponse",
    "SampleResult",
    "SampledSequence",
    "SamplingParams",
    "Serializable",
    "StopReason",
    "Tool",
    "ToolCall",
    "Trajectory",
    "check_binary",
    "make_input_feature",
    "prompt_major",
    "unshifted_labels",
    "validate_input_feature",
    "validate_message",
    "validate_trajectory",
]
