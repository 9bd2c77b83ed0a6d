"""``twinkle.server.tinker.common``: the seeds' import path of the datum converters is the client's functions."""

from twinkle.data_format import IGNORE_INDEX, make_input_feature


def test_the_seed_import_path_gives_the_client_converters():
    from twinkle.server.tinker.common import datum_to_input_feature, input_feature_to_datum
    from twinkle_client import tinker as client_tinker

    assert input_feature_to_datum is client_tinker.input_feature_to_datum
    assert datum_to_input_feature is client_tinker.datum_to_input_feature
    feature = make_input_feature([10, 11, 12], [IGNORE_INDEX, 11, 12])
    datum = input_feature_to_datum(feature)
    assert datum.loss_fn_inputs["target_tokens"].tolist() == [11, 12]
    assert datum_to_input_feature(datum) == feature
