"""Saving and reloading models that use the tf_flash layers, as users do it: `.keras` files,
`model.export()`, `tf.saved_model.save`, each reloaded in a fresh process (tests/saving_helper.py);
a clear error when tf_flash was not imported; tf.distribute.MirroredStrategy over 2 CPU devices."""
import numpy as np
import pytest
import tensorflow as tf
import keras

import saving_helper
import tf_flash  # noqa: F401  pylint: disable=unused-import  (registers the layers the models use)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A trained model in every saved form, with the logits it gives."""
    directory = tmp_path_factory.mktemp("saved")
    model, logits = saving_helper.train_and_save(directory)
    return directory, model, logits


def test_keras_file_round_trip_in_process(saved):
    directory, model, logits = saved
    reloaded = keras.models.load_model(directory / "model.keras")
    tokens, _ = saving_helper.data()
    np.testing.assert_allclose(reloaded.predict(tokens, verbose=0), logits, atol=1e-5)
    assert reloaded.get_layer("mha").get_config() == model.get_layer("mha").get_config()
    assert type(reloaded.get_layer("flash")).__name__ == "FlashAttention"


def test_every_saved_form_reloads_in_a_fresh_process(saved):
    result = saving_helper.assert_reloads(saved[0])
    assert result["export_longer_shape"] == [8, 2]


def test_loading_without_importing_tf_flash_names_it(saved):
    result = saving_helper.run("no_import", saved[0])
    assert not result["tf_flash_imported"]
    assert result["keras_error"] and "tf_flash" in result["keras_error"], result
    assert result["saved_model_error"] and "TfFlash>FlashAttention" in result["saved_model_error"], result


@pytest.mark.parametrize("kind", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_mirrored_strategy_on_two_devices_matches_one_device(kind):
    """Keras fit under MirroredStrategy over 2 devices (logical CPUs, or 2 GPUs: the lent 2-GPU machine)
    gives the weights of the same fit on one device; with dropout it trains (finite losses)."""
    if kind == "gpu" and len(tf.config.list_physical_devices("GPU")) < 2:
        pytest.skip("needs 2 GPUs")
    env = {"CUDA_VISIBLE_DEVICES": ""} if kind == "cpu" else {}
    result = saving_helper.run("distribute", kind, **env)
    assert result["replicas"] == 2, result
    assert result["weights_moved"] > 1e-4
    # On GPUs float32 attention runs on float16 operands (README), and the replicas reduce in another order.
    tol = 1e-5 if kind == "cpu" else 1e-3
    assert result["max_weight_diff"] < tol, result
    np.testing.assert_allclose(result["multi_loss"], result["single_loss"], rtol=tol)
    assert np.all(np.isfinite(result["single_loss"]))
    assert np.all(np.isfinite(result["dropout_loss"]))
