import pytest
import torch

from twinkle.errors import ComponentNotFoundError, ConfigurationError
from twinkle.module import build_optimizer, optimizer_class


def test_names_classes_and_default():
    assert optimizer_class("AdamW") is torch.optim.AdamW
    assert optimizer_class("default") is torch.optim.AdamW
    assert optimizer_class(torch.optim.SGD) is torch.optim.SGD
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert build_optimizer("SGD", params, lr=0.5).param_groups[0]["lr"] == 0.5


def test_errors_are_clear():
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ComponentNotFoundError, match=r"unknown optimizer 'Adamw'.*AdamW"):
        optimizer_class("Adamw")
    with pytest.raises(ConfigurationError, match="cannot build optimizer AdamW"):
        build_optimizer("AdamW", params, lr=-1.0)
    with pytest.raises(ConfigurationError, match="not an instance"):
        build_optimizer(torch.optim.SGD(params, lr=0.1), params)
    with pytest.raises(ConfigurationError, match=r"not a torch\.optim\.Optimizer"):
        optimizer_class(dict)
