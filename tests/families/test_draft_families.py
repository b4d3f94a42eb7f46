"""Draft heads for targets with per-layer-type settings, one tiny random target per family, through the whole path:
build, teacher logits, training from a capture, lossless decoding, save and load, every engine's export.

The families (tests/families/test_sliding_window.py's builders, with the byte tokenizer's vocabulary so the ordinary capture
pipeline runs them, 4 layers, hidden 64, a window of 16 positions):
    llama       the control: one rotary setting, full attention, a plain head
    mistral     every layer slides
    starcoder2  slides; LayerNorm (with bias) as its final norm, gelu MLP
    gemma2      sliding/full; final_logit_softcapping (2.0 here: the tiny model's logits reach it), scaled
                embeddings, (1 + w) RMSNorm
    gemma3      sliding/full with a rotary setting per layer type (local 10k, global 1M); head_dim 32 on hidden 64
                with 4 heads (heads * head_dim != hidden, as Gemma 3 270M's 4 x 256 on 640); scaled embeddings
    gpt_oss     sliding/full, attention sinks, YaRN rotary, MoE; head_dim 32
    cohere2     sliding/full; logit_scale 0.0625; LayerNorm final norm
What the engines take or refuse per family is layerscope/draft/engines.py's (family_refusal, with its sources).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
import yaml
from transformers import GraniteConfig, GraniteForCausalLM, LlamaConfig, LlamaForCausalLM

from layerscope.capture.run import capture
from layerscope.capture.stored import open_capture
from layerscope.decoding import specdec as sd
from layerscope.draft.checkpoint import load_draft, save_draft
from layerscope.draft.engines import ENGINES, target_facts
from layerscope.draft.export.check import check_draft
from layerscope.draft.export.engine_export import export_draft
from layerscope.draft.model import DraftConfig, DraftHead, build_draft_vocab
from layerscope.draft.training.fit import TrainOptions, build_drafters, final_norm
from layerscope.draft.training.loss import Teacher
from layerscope.draft.training.train import train_capture_draft
from layerscope.errors import DraftError
from layerscope.prompts.sets import load_prompts
from layerscope.store import Store
from layerscope.target.load import LoadedModel, byte_tokenizer
from tests.draft.test_speculators import assert_speculators_runs_it_as_layerscope, speculators  # noqa: F401 (a fixture)
from tests.families.test_sliding_window import FAMILIES as SLIDING
from tests.families.test_sliding_window import SHAPE

LAYERS, WINDOW, NEW = [1, 2, 3], 16, 24
FAMILY_FIELDS = {                   # on top of tests/families/test_sliding_window.py's
    "llama": {},
    "mistral": {},
    "starcoder2": {},
    "gemma2": {"final_logit_softcapping": 2.0},
    "gemma3": {"head_dim": 32},
    "gpt_oss": {"head_dim": 32},
    "cohere2": {},
}
ALL = set(ENGINES)
# SpecForge captures through SGLang only (its HF backend was removed in July 2026), so the families SGLang cannot
# capture are served nowhere (engines.family_support; tests/families/test_engine_support.py has every family)
REFUSED = {"llama": set(), "gpt_oss": set(), "mistral": {"vllm", "speculators"},
           "starcoder2": ALL, "gemma2": ALL, "gemma3": ALL, "cohere2": ALL}
OPTIONS = dict(steps=40, batch_size=4, seq_len=64, draft_vocab=128, warmup=5, lr=3e-3, eval_points=1)

pytestmark = pytest.mark.usefixtures("one_thread")


def build_model(name: str, vocab: int, **fields):
    """The family's tiny random causal LM (seeded)."""
    config_class, model_class, base = (LlamaConfig, LlamaForCausalLM, {}) if name == "llama" else SLIDING[name][:3]
    tok = byte_tokenizer()
    shape = {**SHAPE, "vocab_size": vocab, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
             "pad_token_id": tok.pad_token_id, "max_position_embeddings": 1024}
    window = {} if name == "llama" else {"sliding_window": WINDOW}
    torch.manual_seed(0)
    return model_class(config_class(**{**shape, **base, **window, **FAMILY_FIELDS.get(name, {}), **fields})).eval()


def loaded_target(name: str) -> LoadedModel:
    """The family's tiny model as LayerScope holds a target: byte tokenizer, CPU, float32."""
    tok = byte_tokenizer()
    model = build_model(name, len(tok))
    return LoadedModel(model=model, tokenizer=tok, spec=f"tiny-{name}", num_layers=model.config.num_hidden_layers,
                       hidden_size=model.config.hidden_size, fingerprint=f"tiny-{name}-seed0",
                       device=torch.device("cpu"), dtype=torch.float32)


@dataclass
class Trained:
    name: str
    target: LoadedModel
    cap: object                     # the capture (6 builtin prompts, 12 new tokens each)
    head: DraftHead                 # trained on it
    report: object
    losses: list[float]             # per step
    prompt: list[int]               # a captured prompt (chat-encoded), for decoding
    ref: list[int]                  # NEW greedy tokens of the target after it


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = Store(tmp_path_factory.mktemp("families-store"))
    yield s
    s.close()


@pytest.fixture(scope="module", params=list(FAMILY_FIELDS))
def fam(request, store) -> Trained:
    name = request.param
    target = loaded_target(name)
    result = capture(target, load_prompts("builtin", limit=6, seed=0), store, max_new_tokens=12, batch_size=3)
    cap = open_capture(store, result.key)
    seen = []
    head, report = train_capture_draft(cap, LAYERS, target, options=TrainOptions(**OPTIONS),
                                       progress=lambda p: seen.append(p.mean_loss))
    tokens = cap.tokens()
    prompt = tokens["token_id"][(tokens["conversation"] == 0) & ~tokens["is_response"]].tolist()
    ref, _ = sd.collect(sd.autoregressive(target.model, prompt, NEW))
    return Trained(name, target, cap, head, report, seen, prompt, ref)


# ----------------------------------------------------------------------------- the draft's shape


def test_a_draft_is_a_plain_llama_layer_with_the_full_attention_rotary(fam):
    config = fam.target.model.config
    c = DraftConfig.from_target(config, LAYERS, 64)
    assert c.head_dim == config.head_dim and c.num_attention_heads == config.num_attention_heads
    head = DraftHead(c)
    assert head.midlayer.self_attn.q_proj.weight.shape == (c.num_attention_heads * c.head_dim, 2 * c.hidden_size)
    assert head.midlayer.self_attn.o_proj.weight.shape == (c.hidden_size, c.num_attention_heads * c.head_dim)
    hf = c.to_hf_config()
    assert hf["hidden_act"] == "silu" and hf["use_sliding_window"] is False and hf["sliding_window"] is None
    assert hf["norm_before_residual"] is False and isinstance(hf["rope_theta"], float)
    assert not any(isinstance(v, dict) for v in c.rope_parameters.values())      # one flat setting
    x, pos = torch.zeros(1, 5, c.head_dim), torch.arange(5)[None] * 37
    cos, sin = head.rotary(x, pos)
    if fam.name == "gemma3":          # the global layers' 1M, not the local 10k
        assert c.rope_parameters == {"rope_type": "default", "rope_theta": 1_000_000.0} and hf["rope_scaling"] is None
        want_cos, want_sin = fam.target.model.model.rotary_emb(x, pos, "full_attention")
        torch.testing.assert_close((cos, sin), (want_cos, want_sin))
        local, _ = fam.target.model.model.rotary_emb(x, pos, "sliding_attention")
        assert not torch.allclose(cos, local, atol=1e-3)
    elif fam.name == "gpt_oss":       # the target's YaRN, its attention factor included
        assert c.rope_parameters["rope_type"] == "yarn" and c.rope_parameters["rope_theta"] == 150000.0
        assert hf["rope_scaling"]["rope_type"] == "yarn" and hf["rope_scaling"]["factor"] == 32.0
        want_cos, want_sin = fam.target.model.model.rotary_emb(x, pos)          # gpt-oss keeps one half
        half = c.head_dim // 2
        torch.testing.assert_close((cos[..., :half], sin[..., :half]), (want_cos, want_sin))
        assert float(cos[0, 0, 0]) > 1.2                                         # YaRN's attention factor
    else:
        assert c.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}


def test_the_rotary_of_a_per_layer_type_target_without_a_full_attention_entry_is_refused():
    config = build_model("gemma3", 260).config
    config.rope_parameters = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                              "chunked_attention": {"rope_type": "default", "rope_theta": 1e5}}
    with pytest.raises(DraftError, match="full_attention") as e:
        DraftConfig.from_target(config, LAYERS, 64)
    assert "\n" not in str(e.value) and e.value.fix


# ----------------------------------------------------------------------------- the teacher


def test_teacher_logits_are_the_targets_own_from_the_captured_final_state(fam):
    """From the capture's hidden_states[N] (float16), the Teacher gives model(...).logits at the same positions;
    for the families whose head transforms its logits, the output embedding alone does not."""
    model, tokens = fam.target.model, fam.cap.tokens()
    rows = (tokens["conversation"] == 1).nonzero().squeeze(1)
    with torch.no_grad():
        want = model(tokens["token_id"][rows][None]).logits[0]                 # [T, vocab]
    final = fam.cap.layer(fam.target.num_layers, rows)                          # [T, d]
    vocab = want.shape[-1]
    teacher = Teacher.of(model.config, model.get_output_embeddings().weight, torch.zeros(vocab, dtype=torch.long), "cpu")
    got = teacher.logits(final)
    scale = float(want.abs().max())
    assert (got - want).abs().max() < 2e-3 * scale, float((got - want).abs().max())
    raw = final @ model.get_output_embeddings().weight.T
    transformed = fam.name in ("gemma2", "cohere2")
    assert ((raw - want).abs().max() > 0.05 * scale) == transformed
    assert torch.equal(raw.argmax(-1), got.argmax(-1))                          # monotone: the same argmax


def test_granites_logits_scaling_divides():
    """logits_scaling: Granite divides (modeling_granite.py); the Teacher gives its logits."""
    torch.manual_seed(0)
    model = GraniteForCausalLM(GraniteConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, logits_scaling=4.0)).eval()
    ids = torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    teacher = Teacher.of(model.config, model.lm_head.weight, torch.zeros(96, dtype=torch.long), "cpu")
    torch.testing.assert_close(teacher.logits(out.hidden_states[-1][0]), out.logits[0], atol=1e-5, rtol=1e-5)


def test_a_frozen_norm_is_the_targets_final_norm_or_refused(fam):
    """final_norm is the gain of the target's final norm as the draft's RMSNorm reads it (Gemma: 1 + w);
    LayerNorm families have none, and freeze_lm_head says so in one line."""
    model = fam.target.model
    gain = final_norm(model)
    if fam.name in ("starcoder2", "cohere2"):
        assert gain is None
        embed, lm_head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        d2t, t2d = build_draft_vocab(torch.arange(embed.shape[0]), 64, embed.shape[0])
        with pytest.raises(DraftError, match="freeze_lm_head") as e:
            build_drafters(model.config, embed, lm_head, gain, [LAYERS], d2t, t2d,
                           TrainOptions(steps=1, freeze_lm_head=True), "cpu")
        assert "\n" not in str(e.value) and model.config.model_type in str(e.value)
        return
    x = torch.randn(5, model.config.hidden_size) * 3
    with torch.no_grad():
        torch.testing.assert_close(gain * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)), model.model.norm(x),
                                   atol=1e-4, rtol=1e-4)
    if fam.name.startswith("gemma"):
        torch.testing.assert_close(gain, 1 + model.model.norm.weight.float())
    else:
        assert torch.equal(gain, model.model.norm.weight.float())


# ----------------------------------------------------------------------------- training and decoding


def test_training_from_a_capture_lowers_the_loss(fam):
    first, last = sum(fam.losses[:5]) / 5, sum(fam.losses[-5:]) / 5
    assert len(fam.losses) == OPTIONS["steps"] and last < 0.8 * first, (first, last)
    assert fam.report.val_positions > 0 and 0 <= fam.report.val_accuracy[0] <= 1


def test_the_trained_draft_decodes_losslessly_and_is_accepted(fam):
    """Chain and tree equal plain greedy decoding, past the window; the trained draft proposes what the target
    takes (an untrained one is almost never accepted)."""
    assert len(fam.prompt) > WINDOW and len(set(fam.ref)) >= 3
    chain, events = sd.collect(sd.speculative(fam.target.model, fam.head, fam.prompt, NEW, k=3))
    assert chain == fam.ref
    assert sum(e.accepted for e in events) > 0
    tree, _ = sd.collect(sd.speculative(fam.target.model, fam.head, fam.prompt, NEW, tree=sd.TreeSpec(8, 2, 4)))
    assert tree == fam.ref


def test_save_then_load_gives_the_same_draft(fam, tmp_path):
    path = save_draft(tmp_path / "d", fam.head, fam.report.meta, target=fam.target)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["head_dim"] == fam.target.model.config.head_dim and cfg["use_sliding_window"] is False
    loaded = load_draft(path, fam.target)
    assert loaded.config.rope_parameters == fam.head.config.rope_parameters
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, loaded.config.vocab_size, (1, 7), generator=g)
    aux = torch.randn(1, 7, 3 * fam.target.hidden_size, generator=g)
    with torch.no_grad():
        a = fam.head(ids, fam.head.fuse(aux), torch.arange(7)[None])
        b = loaded(ids, loaded.fuse(aux), torch.arange(7)[None])
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    out, _ = sd.collect(sd.speculative(fam.target.model, loaded, fam.prompt, NEW, k=3))
    assert out == fam.ref


# ----------------------------------------------------------------------------- the engines


def test_every_engine_exports_what_it_serves_and_refuses_the_rest_in_one_line(fam, tmp_path, monkeypatch, request):
    path = save_draft(tmp_path / "d", fam.head, fam.report.meta, target=fam.target)
    facts = target_facts(fam.target)
    layers_json = json.loads((path / "layers.json").read_text())
    for engine in ENGINES:
        refused = engine in REFUSED[fam.name]
        assert layers_json["engines"][engine]["ok"] is not refused, engine
        if refused:
            with pytest.raises(DraftError, match=f"Cannot export for {engine}") as e:
                export_draft(path, engine, tmp_path / engine, facts, target=fam.target)
            assert "\n" not in str(e.value) and "layer set" not in e.value.fix, str(e.value)
            assert not (tmp_path / engine).exists()
            continue
        if engine == "speculators":
            folder = tmp_path / "target"                       # speculators reads the verifier from a folder
            fam.target.model.save_pretrained(folder)
            monkeypatch.setattr(fam.target.model.config, "_name_or_path", str(folder))
            out = export_draft(path, engine, tmp_path / engine, facts, target=fam.target)
            layer = json.loads((out / "config.json").read_text())["transformer_layer_config"]
            assert layer["layer_types"] == ["full_attention"] and layer["use_sliding_window"] is False
            assert layer["rope_parameters"] == fam.head.config.rope_parameters and layer["head_dim"] == fam.head.config.head_dim
            monkeypatch.chdir(out)                             # the verifier is named relative to the export
            assert check_draft(out, facts)["ok"]
            assert_speculators_runs_it_as_layerscope(request.getfixturevalue("speculators"), out, fam.head,
                                                     fam.target, LAYERS)
            monkeypatch.chdir(tmp_path)
            continue
        out = export_draft(path, engine, tmp_path / engine, facts)
        report = check_draft(out, facts)
        assert report["ok"], (engine, report["problems"])
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["norm_before_residual"] is False and cfg["use_sliding_window"] is False
        if fam.name == "gpt_oss" and engine in ("sglang", "specforge"):
            # SGLang reads gpt-oss ids as hidden-state boundaries (PR #32334): the layers themselves
            assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == LAYERS
        if engine == "specforge":
            run = yaml.safe_load((out / "specforge.yaml").read_text())
            assert run["model"]["target_backend"] == "sglang"
            # exactly one data source (SpecForge's DataConfig): SGLang's offline states
            assert set(run["data"]) & {"hidden_states_path", "train_data_path"} == {"hidden_states_path"}


def test_a_262k_vocabulary_draft_builds_saves_and_decodes(tmp_path):
    """Gemma 3's 262,144-token vocabulary: the draft vocabulary is a number in config.json (never null), d2t/t2d
    fit, and the draft decodes losslessly."""
    model = build_model("gemma3", 262_144, num_hidden_layers=2)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    d2t, t2d = build_draft_vocab(torch.randint(0, vocab, (20_000,), generator=g), 8192, vocab)
    head = DraftHead(DraftConfig.from_target(model.config, [1], 8192), model.get_input_embeddings().weight, d2t, t2d)
    target = LoadedModel(model=model, tokenizer=None, spec="tiny-gemma3-262k", num_layers=2, hidden_size=64,
                         fingerprint="tiny-gemma3-262k", device=torch.device("cpu"), dtype=torch.float32)
    path = save_draft(tmp_path / "d", head.eval(), {"target_fingerprint": target.fingerprint, "layers": [1]},
                      target=target)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 8192 and cfg["vocab_size"] == vocab
    loaded = load_draft(path, target)
    assert loaded.t2d.shape == (vocab,) and int(loaded.t2d.sum()) == 8192
    prompt = torch.randint(3, vocab, (12,), generator=g).tolist()
    ref, _ = sd.collect(sd.autoregressive(model, prompt, 8))
    out, _ = sd.collect(sd.speculative(model, loaded, prompt, 8, k=2))
    assert out == ref
