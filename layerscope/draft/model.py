"""The EAGLE-3 draft head: one Llama decoder layer that reads the target's hidden states.

Tokens x_0..x_{T-1}; k auxiliary layers of the target (ascending hidden_states indices, README "Layer indices").
    g_t   = fc(concat_l hidden_states[l][t])                          [k*d] -> [d]
    with fc_norm (EAGLE-3.1): g_t = fc(concat_l fc_norm[i](hidden_states[l][t])), one RMSNorm per layer
    step 1, row t:  (embed(x_{t+1}), g_t)      at position t      -> a1_t, predicts x_{t+2}
    step j, row t:  (embed(x_{t+j}), a^{j-1}_t) at position t+j-1 -> a^j_t, predicts x_{t+j+1}
Inside the layer (as vLLM's and SGLang's `llama_eagle3.py` compute it):
    x   = [input_layernorm(embed) ; hidden_norm(h)]                  [2d]
    h'  = h + o_proj(attn(q/k/v_proj(x)))                             residual on the feature stream
    a   = h' + mlp(post_attention_layernorm(h'))                      the pre-norm output, fed to the next step
    logits = lm_head(norm(a))                                         over the draft vocabulary
Module and buffer names are the checkpoint names those engines load (`midlayer.*`, `fc`, `fc_norm.{i}`,
`norm`, `lm_head`, `d2t`, `t2d`); the token embedding is the target's, frozen, shared and never saved.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from layerscope.errors import DraftError
from layerscope.target.config import check_memory
from layerscope.validate import check_number

ARCHITECTURE = "LlamaForCausalLMEagle3"
# The sizes a draft's config may give, inclusive: beyond the largest real targets (hidden 16384, MLP 53248, 262144
# tokens, 128 heads, 10M positions), far below what would overflow an allocation. A config.json is checked against
# them before anything is built (DraftConfig.__post_init__), and its tensors' bytes against the memory (DraftHead).
SIZE_LIMITS = {"hidden_size": 2**16, "target_hidden_size": 2**16, "vocab_size": 2**22, "draft_vocab_size": 2**22,
               "num_attention_heads": 2**10, "num_key_value_heads": 2**10, "head_dim": 2**12,
               "intermediate_size": 2**20, "max_position_embeddings": 2**25}


@dataclass
class DraftConfig:
    hidden_size: int                 # d of the draft (= the target's, so the embedding can be shared)
    target_hidden_size: int          # d of the target's hidden states that fc reads
    vocab_size: int                  # target vocabulary
    draft_vocab_size: int            # V: rows of lm_head
    aux_layers: list[int]            # ascending hidden_states indices of the target
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 2048
    target_num_layers: int | None = None   # N of the target, when known
    fc_norm: bool = False            # an RMSNorm on each auxiliary state before fc (EAGLE-3.1; DraftHead.fc_input)

    def __post_init__(self):
        fix = "The draft's config.json is damaged or not an EAGLE-3 draft's; train or export the draft again"
        for name, top in SIZE_LIMITS.items():
            check_number(f"The draft's {name}", getattr(self, name), minimum=1, maximum=top, integer=True,
                         error=DraftError, fix=fix)
        check_number("The draft's rms_norm_eps", self.rms_norm_eps, minimum=0, maximum=1, above=True, below=True,
                     error=DraftError, fix=fix)
        if self.num_attention_heads % self.num_key_value_heads or self.head_dim % 2:
            raise DraftError(f"The draft's num_key_value_heads = {self.num_key_value_heads} does not divide its "
                             f"num_attention_heads = {self.num_attention_heads}, or its head_dim = {self.head_dim} "
                             "is odd", fix)
        if self.draft_vocab_size > self.vocab_size:
            raise DraftError(f"The draft's draft_vocab_size = {self.draft_vocab_size} exceeds its vocab_size = "
                             f"{self.vocab_size}", fix)
        self.aux_layers = [int(l) for l in self.aux_layers]
        if not self.aux_layers:
            raise DraftError("A draft needs at least one auxiliary layer", "Pass a layer set such as 2,15,27")
        if sorted(set(self.aux_layers)) != self.aux_layers:
            raise DraftError(f"Auxiliary layers {self.aux_layers} must be distinct and ascending",
                             "Engines concatenate the layers in ascending order; sort the set and drop repeats")
        if self.aux_layers[0] < 0 or (self.target_num_layers is not None and self.aux_layers[-1] >= self.target_num_layers):
            top = "N-1" if self.target_num_layers is None else str(self.target_num_layers - 1)
            raise DraftError(f"Auxiliary layers {self.aux_layers} are out of range 0..{top}",
                             "A draft reads hidden_states 0..N-1 of the target")

    @property
    def k(self) -> int:
        return len(self.aux_layers)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint's tensors and their shapes (DraftHead's state_dict), computed without building anything."""
        d, hd, ff, V = self.hidden_size, self.head_dim, self.intermediate_size, self.draft_vocab_size
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        out = {"midlayer.self_attn.q_proj.weight": (q, 2 * d), "midlayer.self_attn.k_proj.weight": (kv, 2 * d),
               "midlayer.self_attn.v_proj.weight": (kv, 2 * d), "midlayer.self_attn.o_proj.weight": (d, q),
               "midlayer.mlp.gate_proj.weight": (ff, d), "midlayer.mlp.up_proj.weight": (ff, d),
               "midlayer.mlp.down_proj.weight": (d, ff)}
        out.update({f"midlayer.{n}.weight": (d,) for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")})
        out.update({"norm.weight": (d,), "lm_head.weight": (V, d), "fc.weight": (d, self.k * self.target_hidden_size),
                    "d2t": (V,), "t2d": (self.vocab_size,)})
        if self.fc_norm:
            out.update({f"fc_norm.{i}.weight": (self.target_hidden_size,) for i in range(self.k)})
        return out

    def nbytes(self) -> int:
        """The bytes of a built head on the CPU: its weights in float32, d2t int64, t2d bool."""
        size = {"d2t": 8, "t2d": 1}
        return sum(math.prod(shape) * size.get(name, 4) for name, shape in self.shapes().items())

    @property
    def fc_norm_widths(self) -> tuple[int, int] | None:
        """(hidden_size, target_hidden_size) of a draft with fc_norm, None without: what engines.refusal checks."""
        return (self.hidden_size, self.target_hidden_size) if self.fc_norm else None

    @classmethod
    def from_target(cls, target_config, aux_layers, draft_vocab_size: int, vocab_size: int | None = None,
                    fc_norm: bool = False, intermediate_size: int | None = None) -> "DraftConfig":
        """Shape the draft like the target's decoder layers (heads, head_dim, MLP width, norm eps) with one flat
        rotary setting (rope_of). The layer stays a plain Llama layer whatever the target's own are (silu, standard
        RMSNorm, 1/sqrt(head_dim) scaling, full attention; no window, sinks, softcap or QK-norm): the engines build
        the draft from its own config.json alone (docs/internals.md, "Drafts for targets with per-layer-type
        settings"). head_dim is the target's even where heads * head_dim != hidden (Gemma 3 270M: 4 x 256 on 640).
        vocab_size: rows of the target's embedding when they differ from config.vocab_size; fc_norm: the per-layer
        norm before fc (DraftHead.fc_input); intermediate_size: the MLP's width when not the target's
        (TrainOptions.draft_intermediate)."""
        d = int(target_config.hidden_size)
        heads = int(target_config.num_attention_heads)
        return cls(hidden_size=d, target_hidden_size=d, vocab_size=int(vocab_size or target_config.vocab_size),
                   draft_vocab_size=int(draft_vocab_size), aux_layers=sorted(int(l) for l in aux_layers),
                   num_attention_heads=heads,
                   num_key_value_heads=int(getattr(target_config, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(target_config, "head_dim", None) or d // heads),
                   intermediate_size=int(intermediate_size or target_config.intermediate_size),
                   rms_norm_eps=float(getattr(target_config, "rms_norm_eps", 1e-5)),
                   rope_parameters=rope_of(target_config),
                   max_position_embeddings=int(getattr(target_config, "max_position_embeddings", 2048) or 2048),
                   target_num_layers=int(target_config.num_hidden_layers), fc_norm=bool(fc_norm))

    def to_hf_config(self) -> dict:
        """config.json as vLLM and SGLang read an EAGLE-3 Llama draft (see docs/drafts.md)."""
        rope = dict(self.rope_parameters)
        theta = rope.pop("rope_theta")
        scaling = rope if rope.get("rope_type", "default") != "default" else None
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "target_hidden_size": self.target_hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": theta,
            "rope_scaling": scaling,
            # full attention, said explicitly: the draft never slides, whatever its target's layers do
            "use_sliding_window": False,
            "sliding_window": None,
            # the residual is the hidden stream before hidden_norm (DraftLayer.finish). vLLM reads a missing key as
            # False in this format but as True in speculators' (vllm/transformers_utils/configs/speculators/algos.py)
            "norm_before_residual": False,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
            # the per-layer RMSNorm before fc, said either way: vLLM, SGLang and SpecForge read this top-level key
            # (getattr(config, "fc_norm", False)); see DraftHead.fc_input for the sources
            "fc_norm": bool(self.fc_norm),
            # the draft feeds its pre-norm output to the next step (EAGLE-3); SpecForge's llama3_eagle.py took a
            # missing norm_output as true until its PR #879, so it is said
            "norm_output": False,
            # vLLM: id l = the input of decoder layer l = hidden_states[l]  (our convention)
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
            # SGLang: reads only this nested key and captures the output of layer id, i.e. hidden_states[id+1]
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [l - 1 for l in self.aux_layers],
                             "use_aux_hidden_state": True},
        }

    @classmethod
    def from_hf_config(cls, cfg: dict, aux_layers: list[int] | None = None) -> "DraftConfig":
        """Inverse of to_hf_config. Layer ids: `aux_layers`, else the vLLM key, else SGLang's (+1)."""
        if aux_layers is None:
            if cfg.get("eagle_aux_hidden_state_layer_ids"):
                aux_layers = cfg["eagle_aux_hidden_state_layer_ids"]
            elif (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"):
                aux_layers = [l + 1 for l in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
            else:
                raise DraftError("The draft's config.json names no auxiliary layers",
                                 "It needs eagle_aux_hidden_state_layer_ids (vLLM) or eagle_config.eagle_aux_hidden_state_layer_ids (SGLang)")
        try:
            heads = int(cfg["num_attention_heads"])
            rope = {"rope_type": "default", **(cfg.get("rope_scaling") or {}), "rope_theta": float(cfg.get("rope_theta", 10000.0))}
            return cls(hidden_size=int(cfg["hidden_size"]), target_hidden_size=int(cfg.get("target_hidden_size") or cfg["hidden_size"]),
                       vocab_size=int(cfg["vocab_size"]), draft_vocab_size=int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
                       aux_layers=list(aux_layers), num_attention_heads=heads,
                       num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                       head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
                       intermediate_size=int(cfg["intermediate_size"]), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                       rope_parameters=rope, max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
                       fc_norm=fc_norm_of(cfg))
        except (KeyError, TypeError, ValueError) as e:
            raise DraftError(f"The draft's config.json is missing or has a bad value for {e}",
                             "Use a config.json written by LayerScope or an EAGLE-3 Llama draft config") from None

    def to_dict(self) -> dict:
        return asdict(self)


def fc_norm_of(cfg: dict) -> bool:
    """Whether a draft's config.json asks for the per-layer norm before fc: the top-level `fc_norm` every engine
    reads (a missing key is False there too). A non-boolean value is refused: an engine would read its truth."""
    value = cfg.get("fc_norm", False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise DraftError(f"The draft's config.json has fc_norm = {value!r}, not true or false",
                         "Write \"fc_norm\": true or false (or train the draft again)")
    return value


def rope_of(target_config) -> dict:
    """The one flat rotary setting {rope_type, rope_theta, ...} of a draft for this target (transformers 4 or 5).

    A target with one setting gives it. A target with one per layer type (transformers 5 rope_parameters keyed by
    layer type; Gemma 3: sliding_attention 10k local, full_attention 1M global, with linear scaling on 4B and up)
    gives its full_attention entry: the draft attends over the whole context, as the target's global layers do
    (SpecForge configs/gemma3-1b-eagle3.json writes rope_theta 1e6 and use_sliding_window false). The engines
    read one flat setting from the draft's config.json (vLLM and SGLang llama_eagle3.py, SpecForge
    llama3_eagle.py get_rope_config); speculators would collapse a per-type one to its sliding entry
    (src/speculators/models/utils.py flatten_rope_parameters). partial_rotary_factor is left out: the draft
    rotates whole heads (speculators' train/cli.py drops it for the same reason)."""
    params = getattr(target_config, "rope_parameters", None)
    if isinstance(params, dict) and params and "rope_theta" not in params:
        per_type = {k: v for k, v in params.items() if isinstance(v, dict)}
        params = per_type.get("full_attention") or (next(iter(per_type.values())) if len(per_type) == 1 else None)
        if not isinstance(params, dict) or "rope_theta" not in params:
            raise DraftError(f"The target's per-layer-type rotary parameters {sorted(per_type)} have no full_attention "
                             "entry with a rope_theta to give the draft", "Draft heads take the rotary setting of the "
                             "target's full-attention layers; this target names none")
    if isinstance(params, dict) and "rope_theta" in params:
        rope = {"rope_type": "default", **params}
    else:
        scaling = getattr(target_config, "rope_scaling", None) or {}
        rope = {"rope_type": scaling.get("rope_type", scaling.get("type", "default")), **scaling,
                "rope_theta": float(getattr(target_config, "rope_theta", 10000.0))}
    rope.pop("partial_rotary_factor", None)
    rope.pop("type", None)
    return rope


# Config fields that name a transform transformers applies to the logits after the output embedding, and how: the
# target's logits are softcap(scale * lm_head(final)). Monotone, so they keep the argmax (the verifier's greedy
# choice); they change the distribution a draft is trained toward. A draft's own logits are never transformed
# (vLLM's and SGLang's llama_eagle3.py build their LogitsProcessor without a soft cap).
# ----------------------------------------------------------------------------- vocabulary

def check_vocab_maps(d2t, t2d, config: DraftConfig) -> None:
    """The one check of a draft's vocabulary maps (built, loaded or imported): d2t [V] of whole numbers mapping each
    draft id i to the target id i + d2t[i], every one inside the target vocabulary and none twice; t2d [vocab] of
    booleans, true at exactly those target ids. A DraftError naming what is wrong otherwise."""
    V, vocab = config.draft_vocab_size, config.vocab_size
    fix = "The draft's vocabulary maps are damaged; train the draft again (build_draft_vocab makes them)"
    if t2d is None or not isinstance(d2t, torch.Tensor) or not isinstance(t2d, torch.Tensor):
        raise DraftError("A draft needs both d2t and t2d", fix)
    if d2t.shape != (V,) or t2d.shape != (vocab,):
        raise DraftError(f"d2t/t2d have shapes {tuple(d2t.shape)}/{tuple(t2d.shape)}, expected ({V},)/({vocab},)", fix)
    if d2t.is_floating_point() or d2t.is_complex() or d2t.dtype == torch.bool or t2d.dtype not in (torch.bool, torch.uint8):
        raise DraftError(f"d2t/t2d are {d2t.dtype}/{t2d.dtype}, expected whole numbers/booleans", fix)
    targets = d2t.long() + torch.arange(V, device=d2t.device)
    low, high = int(targets.min()), int(targets.max())
    if low < 0 or high >= vocab:
        raise DraftError(f"d2t maps draft ids to target ids {low}..{high}, outside the target vocabulary 0..{vocab - 1}", fix)
    chosen = torch.zeros(vocab, dtype=torch.bool, device=targets.device)
    chosen[targets] = True
    if int(chosen.sum()) != V or t2d.max() > 1 or not torch.equal(chosen, t2d.bool().to(chosen.device)):
        raise DraftError(f"d2t and t2d disagree (d2t maps {V} draft ids to {int(chosen.sum())} distinct target ids, "
                         f"t2d marks {int(t2d.bool().sum())})", fix)


def build_draft_vocab(token_ids: torch.Tensor, V: int, target_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The V most frequent target ids in `token_ids` (ties and unseen ids by ascending id), sorted.

    Returns d2t [V] int64 with target_id = draft_id + d2t[draft_id], and t2d [target_vocab] bool.
    """
    V = min(int(V), int(target_vocab))
    counts = torch.bincount(token_ids.long().flatten(), minlength=target_vocab)[:target_vocab]
    order = torch.sort(-counts, stable=True).indices        # by count, then by id
    chosen = order[:V].sort().values
    d2t = chosen - torch.arange(V)
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


# ----------------------------------------------------------------------------- layers

class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    """q/k/v from the 2d-wide input, o back to d. Shapes: q [B,H,T,hd], k/v [B,KV,T,hd]."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.H, self.KV, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, self.H * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.KV * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.KV * self.hd, bias=False)
        self.o_proj = nn.Linear(self.H * self.hd, c.hidden_size, bias=False)

    def qkv(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.KV, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.KV, self.hd).transpose(1, 2)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def out(self, o):
        B, H, T, hd = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * hd))

    def repeat(self, kv):
        """[B,KV,S,hd] -> [B,H,S,hd] for grouped-query attention."""
        return kv.repeat_interleave(self.H // self.KV, dim=1) if self.H != self.KV else kv


class MLP(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """The one decoder layer (`midlayer`). project() -> attention (caller's choice of keys) -> finish()."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def project(self, embeds, hidden, cos, sin):
        """embeds, hidden [B,T,d] -> q [B,H,T,hd], k, v [B,KV,T,hd]."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        return self.self_attn.qkv(x, cos, sin)

    def finish(self, attn, hidden):
        """attn [B,H,T,hd], hidden (the residual) [B,T,d] -> pre-norm output [B,T,d]."""
        h = hidden + self.self_attn.out(attn)
        return h + self.mlp(self.post_attention_layernorm(h))


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x, cos, sin):
    """x [B,h,T,hd], cos/sin [B,T,hd]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class Rotary(nn.Module):
    """The target's rotary embedding (transformers' Llama implementation, any rope_type it knows)."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        # transformers takes seconds to load; the CLI imports this module at start-up, a draft is built later
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        hf = LlamaConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads, head_dim=c.head_dim,
                         max_position_embeddings=c.max_position_embeddings, rope_parameters=dict(c.rope_parameters))
        self.inner = LlamaRotaryEmbedding(hf)

    def forward(self, x, position_ids):
        """x: any tensor of the compute dtype/device; position_ids [B,T] -> cos, sin [B,T,hd]."""
        return self.inner(x, position_ids)


# ----------------------------------------------------------------------------- cache

class DraftCache:
    """Keys and values of the draft's one layer: k, v [B, KV, S, hd], already rotated."""

    def __init__(self):
        self.k = None
        self.v = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        """Keep the first `length` entries; a negative `length` drops that many from the end."""
        if self.k is None:
            return
        keep = length if length >= 0 else max(self.length + length, 0)
        self.k, self.v = self.k[:, :, :keep], self.v[:, :, :keep]


# ----------------------------------------------------------------------------- the head

class DraftHead(nn.Module):
    def __init__(self, config: DraftConfig, embed_weight: torch.Tensor | None = None,
                 d2t: torch.Tensor | None = None, t2d: torch.Tensor | None = None):
        super().__init__()
        c = self.config = config
        if torch.get_default_device().type != "meta":      # the one memory check before a draft is built
            check_memory(c.nbytes(), "The draft", "Check that its config.json describes the draft you meant "
                                "(its sizes give the memory), close other programs, or use a machine with more memory",
                                cuda=False, error=DraftError)
        self.midlayer = DraftLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.fc = nn.Linear(c.k * c.target_hidden_size, c.hidden_size, bias=False)  # last: other inits do not depend on k
        # gains start at 1 and draw no random numbers: a fresh draft with fc_norm has the same Linear weights as one
        # without (same seed), and differs only by the normalisation
        self.fc_norm = nn.ModuleList([RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in range(c.k)]) if c.fc_norm else None
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        self.rotary = Rotary(c)
        if d2t is None:
            # the identity onto the first V target ids, and t2d marking exactly those (check_vocab_maps' rule)
            d2t, t2d = torch.zeros(c.draft_vocab_size, dtype=torch.long), torch.arange(c.vocab_size) < c.draft_vocab_size
        else:
            check_vocab_maps(d2t, t2d, c)
        self.register_buffer("d2t", d2t.long())
        self.register_buffer("t2d", t2d.bool())
        self.register_buffer("embed_weight", None, persistent=False)
        if embed_weight is not None:
            self.set_embedding(embed_weight)

    @property
    def aux_layers(self) -> list[int]:
        return list(self.config.aux_layers)

    def set_embedding(self, weight: torch.Tensor) -> None:
        """Share the target's input embedding [vocab, d] (frozen; not part of the checkpoint)."""
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise DraftError(f"Embedding of shape {tuple(weight.shape)} does not fit a draft for vocabulary "
                             f"{self.config.vocab_size} and hidden size {self.config.hidden_size}",
                             "Use the embedding of the target the draft was built for")
        self.embed_weight = weight.detach()

    def embed(self, input_ids):
        if self.embed_weight is None:
            raise DraftError("This draft has no token embedding attached",
                             "Load it with load_draft(path, target) or call set_embedding(target embedding)")
        return F.embedding(input_ids, self.embed_weight).to(self.fc.weight.dtype)

    def fc_input(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """What fc reads: [B, T, k*d_target] (layers concatenated in ascending order) in fc's dtype, each layer's
        d_target-wide chunk through its own RMSNorm when the draft has fc_norm. That is how the engines define it:
        speculators `hidden_states.chunk(len(self.fc_norm), -1)`, each chunk normed, concatenated, then fc
        (src/speculators/models/eagle3/core.py, Eagle3DraftModel.forward; config field Eagle3SpeculatorConfig.fc_norm,
        models/eagle3/config.py); SGLang's LlamaModel.forward the same with `self.fc_norm[i] =
        RMSNorm(target_hidden_size)` (python/sglang/srt/models/llama_eagle3.py); SpecForge's project_hidden_states
        (specforge/modeling/draft/llama3_eagle.py); vLLM's combine_hidden_states (vllm/model_executor/models/
        llama_eagle3.py, since PR #42764). Weights `fc_norm.{i}.weight` in all of them."""
        x = aux_hidden.to(self.fc.weight.dtype)
        if self.fc_norm is None:
            return x
        return torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, x.chunk(len(self.fc_norm), dim=-1))], dim=-1)

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, k*d_target] (layers concatenated in ascending order) -> g [B, T, d]."""
        return self.fc(self.fc_input(aux_hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [B,T,d] -> logits over the draft vocabulary [B,T,V]."""
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def forward(self, input_ids, hidden, position_ids, cache: DraftCache | None = None, attention_mask=None):
        """One pass for decoding. input_ids [B,T], hidden [B,T,d] (g from fuse, or the draft's own previous
        output), position_ids [B,T]. With a cache, new keys are appended and attention covers all S cached
        slots; attention_mask bool [B,1,T,S] (True = may attend), default: slot s visible to new token i iff
        s <= S_old + i. Returns logits [B,T,V_draft] and the pre-norm hidden output [B,T,d]."""
        hidden = hidden.to(self.fc.weight.dtype)
        cos, sin = self.rotary(hidden, position_ids)
        q, k, v = self.midlayer.project(self.embed(input_ids), hidden, cos, sin)
        past = cache.length if cache is not None else 0
        if cache is not None:
            k, v = cache.append(k, v)
        attn = self.midlayer.self_attn
        if attention_mask is None:
            T, S = q.shape[2], k.shape[2]
            attention_mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=past)
        o = F.scaled_dot_product_attention(q, attn.repeat(k), attn.repeat(v), attn_mask=attention_mask)
        out = self.midlayer.finish(o, hidden)
        return self.logits(out), out

    def unroll(self, input_ids: list[torch.Tensor], hidden: torch.Tensor, position_ids: torch.Tensor,
               with_logits: bool = True):
        """Training-time test over whole sequences. input_ids[j-1] [B,T] holds x_{t+j} at row t; hidden is g
        [B,T,d]; position_ids [B,T] are the rows' positions (step j runs at position + j - 1). Step j at row t
        attends to step-1 keys at rows <= t and to steps 2..j at row t. Returns [(logits, hidden)] per step
        (logits None when with_logits is False: training takes them only where the loss is counted)."""
        attn = self.midlayer.self_attn
        h = hidden.to(self.fc.weight.dtype)
        T = h.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
        k1 = v1 = None
        diag_k, diag_v, outs = [], [], []
        for j, ids in enumerate(input_ids):
            cos, sin = self.rotary(h, position_ids + j)
            q, k, v = self.midlayer.project(self.embed(ids), h, cos, sin)
            if j == 0:
                k1, v1 = attn.repeat(k), attn.repeat(v)
                o = F.scaled_dot_product_attention(q, k1, v1, attn_mask=causal)
            else:
                diag_k.append(attn.repeat(k))
                diag_v.append(attn.repeat(v))
                o = ttt_attention(q, k1, v1, diag_k, diag_v, causal)
            h = self.midlayer.finish(o, h)
            outs.append((self.logits(h) if with_logits else None, h))
        return outs


def ttt_attention(q, k1, v1, diag_k, diag_v, causal):
    """q [B,H,T,hd]; k1/v1 [B,H,T,hd] (step 1, causal over rows); diag_k/v lists of [B,H,T,hd], each seen
    only by its own row. Returns [B,H,T,hd]."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k1.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~causal, float("-inf"))
    diag = torch.stack([(q * k).sum(-1) for k in diag_k], dim=-1) * scale        # [B,H,T,m]
    att = torch.softmax(torch.cat([scores, diag], dim=-1).float(), dim=-1).to(q.dtype)
    T = k1.shape[2]
    return att[..., :T] @ v1 + (att[..., T:].unsqueeze(-1) * torch.stack(diag_v, dim=-2)).sum(-2)
