"""Model specs resolve to loaded models; bad specs give clear errors."""


import pytest
import torch

import layerscope.target.gguf as target_gguf
from layerscope.errors import ModelSpecError
from layerscope.target import config, files
from layerscope.target.load import load_model, tiny_model


def test_tiny_model_is_deterministic_and_described(tiny):
    again = tiny_model()
    assert tiny.num_layers == 4 and tiny.hidden_size == 64
    assert tiny.fingerprint == again.fingerprint
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(tiny.model(ids).logits, again.model(ids).logits)
    assert tiny_model(seed=1).fingerprint != tiny.fingerprint


def test_tiny_options_parse():
    m = load_model("tiny-llama:layers=2,hidden=32,seed=3")
    assert (m.num_layers, m.hidden_size) == (2, 32)
    with pytest.raises(ModelSpecError, match="tiny-llama option"):
        load_model("tiny-llama:depth=2")


def test_byte_tokenizer_round_trips_text(tiny):
    text = "Grüße, world! 1+1=2"
    ids = tiny.tokenizer(text, add_special_tokens=False).input_ids
    assert tiny.tokenizer.decode(ids) == text


@pytest.mark.parametrize("spec, match", [
    ("no-such-model", "Unknown model spec"),
    ("/definitely/missing/model.gguf", "does not exist"),
    ("", "No model spec"),
])
def test_bad_specs_are_clear(spec, match):
    with pytest.raises(ModelSpecError, match=match):
        load_model(spec)


def test_directory_without_model_is_refused(tmp_path):
    with pytest.raises(ModelSpecError, match="not a loadable model directory"):
        load_model(str(tmp_path))


def test_missing_hub_model_fails_fast_without_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSpecError, match="not in the local Hugging Face cache"):
        load_model("nobody-here/not-a-model-xyz")


def test_model_too_big_for_memory_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(config, "available_memory", lambda cuda=True: 1024)
    saved = tmp_path / "m"
    tiny = tiny_model()
    tiny.model.save_pretrained(saved)
    tiny.tokenizer.save_pretrained(saved)
    with pytest.raises(ModelSpecError, match="needs about"):
        load_model(str(saved))


def test_saved_directory_loads_with_same_logits(tmp_path, tiny):
    saved = tmp_path / "m"
    tiny.model.save_pretrained(saved)
    tiny.tokenizer.save_pretrained(saved)
    loaded = load_model(str(saved))
    ids = torch.tensor([[5, 6, 7]])
    assert torch.allclose(loaded.model(ids).logits, tiny.model(ids).logits, atol=1e-5)
    assert loaded.fingerprint.startswith("hf-")


@pytest.mark.smollm2
def test_smollm2_loads_and_reloads_from_store(smollm2, session_store, monkeypatch):
    assert (smollm2.num_layers, smollm2.hidden_size) == (30, 576)
    assert smollm2.tokenizer.chat_template

    def never(*a, **k):
        raise AssertionError("a reload parsed or hashed the GGUF file again instead of reading the store's copy")
    monkeypatch.setattr(target_gguf.gguf, "GGUFReader", never)        # the slow part of a first load
    monkeypatch.setattr(files, "file_sha256", never)            # its digest is remembered in the store
    again = load_model("smollm2-135m", store=session_store)
    assert again.fingerprint == smollm2.fingerprint
    ids = torch.tensor([[1, 4093, 198, 26843, 665]])
    assert torch.allclose(again.model(ids).logits, smollm2.model(ids).logits, atol=1e-5)
