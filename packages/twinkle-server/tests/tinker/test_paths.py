"""tinker:// and twinkle:// checkpoint paths and the store names they map to."""

from __future__ import annotations

import pytest
from tinker import types

from twinkle.errors import InvalidInputError
from twinkle.server.tinker.paths import CheckpointPath, parse_checkpoint_id, parse_path, training_run_id


def test_training_and_sampler_paths_round_trip_through_store_names():
    run = training_run_id("ses-abc", 3)
    assert run == "ses-abc:train:3"  # the SDK computes this id itself for models created by loading
    for kind, folder, store_name in (
        ("training", "weights", "ckpt"),
        ("sampler", "sampler_weights", "sampler_weights/ckpt"),
    ):
        path = parse_path(f"tinker://{run}/{folder}/ckpt")
        assert (path.run_id, path.kind, path.name, path.store_name) == (run, kind, "ckpt", store_name)
        assert CheckpointPath.from_store_name(run, store_name) == path
        parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(path.tinker_path)  # the SDK's own parser
        assert (parsed.training_run_id, parsed.checkpoint_type, parsed.checkpoint_id) == (run, kind, path.checkpoint_id)


def test_native_paths_name_the_same_checkpoints():
    assert parse_path("twinkle://run-1/ckpt") == parse_path("tinker://run-1/weights/ckpt")
    assert parse_path("twinkle://run-1/sampler_weights/s") == parse_path("tinker://run-1/sampler_weights/s")


@pytest.mark.parametrize(
    "bad",
    ["", "tinker://", "tinker://run/other/x", "tinker://run/weights/", "tinker://run/weights/a/b", "s3://x", 7],
)
def test_malformed_paths_are_refused_with_the_expected_forms(bad):
    with pytest.raises(InvalidInputError, match="checkpoint"):
        parse_path(bad)


def test_checkpoint_ids_from_the_rest_api():
    assert parse_checkpoint_id("r", "sampler_weights/x").store_name == "sampler_weights/x"
    with pytest.raises(InvalidInputError, match="expected 'weights/<name>'"):
        parse_checkpoint_id("r", "x")
