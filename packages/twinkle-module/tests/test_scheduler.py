import pytest
import torch
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from twinkle.errors import ConfigurationError
from twinkle.module import ConstantScheduler, CosineWarmupScheduler, LinearWarmupScheduler
from twinkle.registry import build


def _lrs(make, steps=26):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = make(optimizer)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize(
    ("ours", "reference"),
    [
        (lambda o: CosineWarmupScheduler(o, 5, 25), lambda o: get_cosine_schedule_with_warmup(o, 5, 25)),
        (lambda o: LinearWarmupScheduler(o, 5, 25), lambda o: get_linear_schedule_with_warmup(o, 5, 25)),
        (lambda o: ConstantScheduler(o, 5), lambda o: get_constant_schedule_with_warmup(o, 5)),
    ],
)
def test_schedules_match_transformers(ours, reference):
    assert _lrs(ours) == pytest.approx(_lrs(reference), abs=1e-12)


def test_min_lr_ratio_floors_the_decay():
    lrs = _lrs(lambda o: CosineWarmupScheduler(o, 0, 10, min_lr_ratio=0.1), steps=15)
    assert lrs[0] == pytest.approx(0.1) and min(lrs) == pytest.approx(0.01)


def test_resolution_by_name_and_megatron_style_default():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build("lr_scheduler", "default", optimizer=optimizer, lr_decay_steps=10, max_lr=2e-4)
    assert isinstance(scheduler, CosineWarmupScheduler)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-4)
    assert isinstance(build("lr_scheduler", "LinearWarmupScheduler", optimizer=optimizer), LinearWarmupScheduler)


def test_state_dict_round_trip_resumes_the_schedule():
    def run(resume_at=None):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = CosineWarmupScheduler(optimizer, 2, 10)
        for _ in range(resume_at or 0):
            optimizer.step()
            scheduler.step()
        return optimizer, scheduler

    _, full = run(6)
    optimizer, resumed = run()
    resumed.load_state_dict(run(6)[1].state_dict())
    assert resumed.get_last_lr() == full.get_last_lr()
    del optimizer


def test_bad_steps():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ConfigurationError, match="num_training_steps"):
        CosineWarmupScheduler(optimizer, 10, 5)
    with pytest.raises(ConfigurationError, match="num_warmup_steps must be >= 0"):
        LinearWarmupScheduler(optimizer, -1, 5)
