"""transformers' architectures from tiny configs with random weights, for a model-zoo conformance suite.

Nothing is downloaded (``HF_HUB_OFFLINE=1``): every model is built from its config class, shrunk
by :func:`tiny_config` to a vocabulary of 96 tokens, hidden size 32, 2 layers (2 encoder and 2
decoder layers for sequence-to-sequence models), 4 attention heads over 2 key/value heads,
4 experts (2 per token) for mixtures of experts, every dropout 0.0, and the rest of each
architecture's defaults (tied embeddings, norms, biases, rotary variants, sliding windows).

The shrinker sets the ``GENERIC`` attribute names wherever the default config has them; ``FAMILY``
holds the few per-model_type overrides where those names do not fit (or the defaults do not build).

``FULL_MATRIX``
    The families behind the most used open models, each to be trained under every parallel
    layout: llama (and ``llama-tied``), mistral, mixtral, qwen2/qwen3 (and their MoE), gemma
    1/2/3 (norms with offsets), phi, falcon and gpt_neox (fused interleaved q/k/v), gpt2,
    deepseek (latent attention), t5 and bart (encoder-decoder), bert and roberta (masked LM), ...
``SWEEP``
    Every other text-only causal-LM and sequence-to-sequence model type in transformers' auto
    mappings (computed from them); those left out are in ``SKIPPED``, each with its reason.
``FLOAT32``
    The architectures that cannot run in float64, with the reason; every other one runs in
    float64.
``SEES_AHEAD``
    Causal entries whose model attends to later tokens as well.

The interface is uniform: :func:`build` a model (seeded, train mode), :func:`batch` the inputs
of one step, :func:`forward` and :func:`loss`. ``python -m tests.zoo.architectures [NAME ...]``
trains each architecture 2 AdamW steps in one process and prints one line per architecture.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Nothing is downloaded: transformers is imported later, by the functions below.
os.environ["HF_HUB_OFFLINE"] = "1"

Kind = Literal["causal", "seq2seq", "masked"]

VOCABULARY = 96
HIDDEN = 32
INTERMEDIATE = 48
EXPERT_INTERMEDIATE = 16
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
POSITIONS = 64
EXPERTS = 4
EXPERTS_PER_TOKEN = 2
#: Sliding attention windows shorter than ``SEQUENCE``, so that the window masks something.
WINDOW = 4
#: Special token ids. The decoder starts from EOS (as BART's does), not from PAD, which some models mask.
PAD, BOS, EOS, DECODER_START = 0, 1, 2, 2
#: Token ids of the batches are drawn from ``FIRST_TOKEN .. VOCABULARY - 1``, above the special ones.
FIRST_TOKEN = 3
#: What masked-LM batches put in place of the masked tokens.
MASK = FIRST_TOKEN
BATCH, SEQUENCE = 4, 8
SEED = 0
#: More parameters than this and the check refuses to build: the shrinker missed an attribute.
MAX_PARAMETERS = 200_000

# --------------------------------------------------------------------------------------------
# The shrinker
# --------------------------------------------------------------------------------------------

#: Generic attribute names -> tiny value; each is set only where the default config has it.
GENERIC: dict[str, Any] = {
    **dict.fromkeys(["vocab_size", "src_vocab_size", "tgt_vocab_size", "decoder_vocab_size"], VOCABULARY),
    **dict.fromkeys(["hidden_size", "d_model", "n_embd", "dim", "emb_dim", "embedding_size"], HIDDEN),
    **dict.fromkeys(
        ["word_embed_proj_dim", "input_embedding_size", "output_embedding_size", "hidden_size_global"], HIDDEN
    ),
    **dict.fromkeys(
        ["intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner"], INTERMEDIATE
    ),
    **dict.fromkeys(
        ["ffn_hidden_size", "feed_forward_size", "dim_ff", "dff", "d_inner", "dense_intermediate_size"], INTERMEDIATE
    ),
    **dict.fromkeys(
        [
            "moe_intermediate_size",
            "expert_ffn_hidden_size",
            "shared_expert_intermediate_size",
            "shared_experts_intermediate_size",
            "shared_intermediate_size",
            "moe_shared_expert_intermediate_size",
        ],
        EXPERT_INTERMEDIATE,
    ),
    **dict.fromkeys(
        [
            "num_hidden_layers",
            "num_layers",
            "n_layer",
            "n_layers",
            "encoder_layers",
            "decoder_layers",
            "num_decoder_layers",
            "num_encoder_layers",
        ],
        LAYERS,
    ),
    **dict.fromkeys(
        [
            "num_attention_heads",
            "n_head",
            "n_heads",
            "num_heads",
            "encoder_attention_heads",
            "decoder_attention_heads",
            "num_encoder_attention_heads",
            "num_decoder_attention_heads",
            "attention_heads",
        ],
        HEADS,
    ),
    **dict.fromkeys(["num_key_value_heads", "num_kv_heads", "kv_n_heads"], KV_HEADS),
    # Partial rotary embeddings (GPT-J, CodeGen): half of each head.
    "rotary_dim": HEAD_DIM // 2,
    **dict.fromkeys(
        ["head_dim", "d_kv", "dim_head", "attention_head_dim", "attention_head_size", "kv_channels"], HEAD_DIM
    ),
    **dict.fromkeys(
        [
            "max_position_embeddings",
            "n_positions",
            "n_ctx",
            "max_seq_len",
            "model_max_length",
            "max_target_positions",
            "max_source_positions",
            "max_encoder_position_embeddings",
            "max_decoder_position_embeddings",
        ],
        POSITIONS,
    ),
    **dict.fromkeys(["num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"], EXPERTS),
    **dict.fromkeys(
        ["num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "moe_top_k"], EXPERTS_PER_TOKEN
    ),
    # Expert groups and dense layers first (DeepSeek V3 style): one dense layer, then experts.
    **dict.fromkeys(["n_group", "num_expert_group", "topk_group"], 1),
    "first_k_dense_replace": 1,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    # Multi-head latent attention (DeepSeek V2/V3 and their descendants), its low-rank outputs (V4).
    **dict.fromkeys(["kv_lora_rank", "q_lora_rank", "o_lora_rank"], 16),
    "o_groups": 2,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 12,
    "v_head_dim": 8,
    # Indexers of sparse attention (DeepSeek V3.2 and others).
    **dict.fromkeys(["index_n_heads", "indexer_n_heads"], HEADS),
    **dict.fromkeys(["index_head_dim", "indexer_head_dim"], HEAD_DIM),
    "index_topk": WINDOW,
    # Linear attention (gated delta-net of Qwen3-Next, Kimi linear attention, ...).
    "linear_num_key_heads": KV_HEADS,
    "linear_num_value_heads": HEADS,
    "linear_num_heads": HEADS,
    **dict.fromkeys(["linear_key_head_dim", "linear_value_head_dim", "linear_head_dim"], HEAD_DIM),
    # Separate sizes of the sliding-window attention layers.
    "swa_num_attention_heads": HEADS,
    "swa_num_key_value_heads": KV_HEADS,
    "swa_head_dim": HEAD_DIM,
    # State-space layers (Mamba and hybrids): 8 heads of 8 over the expanded 2 x hidden.
    **dict.fromkeys(["state_size", "ssm_state_size", "mamba_d_state"], 8),
    **dict.fromkeys(["mamba_n_heads", "mamba_num_heads", "mamba_d_head", "mamba_head_dim"], 8),
    "mamba_d_ssm": 2 * HIDDEN,
    **dict.fromkeys(["time_step_rank", "mamba_dt_rank"], 4),
    # Per-layer inputs (Gemma 3n / 4).
    "vocab_size_per_layer_input": VOCABULARY,
    "hidden_size_per_layer_input": HEAD_DIM,
    # Gemma's attention scale: 1 / sqrt(query_pre_attn_scalar).
    "query_pre_attn_scalar": HEAD_DIM,
    **dict.fromkeys(["router_jitter_noise", "input_jitter_noise"], 0.0),
    "use_cache": False,
}

#: Generic attributes whose None means "no such part" (no low-rank queries, no indexer): left None.
OPTIONAL = frozenset(
    ["q_lora_rank", "o_lora_rank", "index_n_heads", "indexer_n_heads", "index_head_dim", "indexer_head_dim"]
    + ["index_topk", "o_groups"]
)

#: Attribute names of the special tokens -> their tiny id (set where the default is not None).
SPECIAL_TOKENS: dict[str, int] = {
    "pad_token_id": PAD,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "decoder_start_token_id": DECODER_START,
}

#: Where the generic names do not fit: model_type -> attribute overrides, applied last (merged
#: into the shrunk sub-config where the attribute is a sub-config).
FAMILY: dict[str, dict[str, Any]] = {
    # ``hidden_dim`` is DistilBERT's feed-forward width.
    "distilbert": {"hidden_dim": INTERMEDIATE},
    # DbrxAttention reads ``attn_config.rope_theta``, which DbrxAttentionConfig no longer defines,
    # and clamps q/k/v to ``clip_qkv`` even where it is None (its default).
    "dbrx": {"attn_config": {"rope_theta": 10_000.0, "clip_qkv": 8.0}},
    # Defaults that do not build: None where the model needs a value.
    "dots1": {"n_shared_experts": 1},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10_000.0}}},
    "qwen4_exp_text": {
        "indexer_n_heads": HEADS,
        "indexer_kv_heads": 1,
        "indexer_head_dim": HEAD_DIM,
        "indexer_budget": WINDOW,
        "indexer_compress_ratio": 2,
        "hc_lowrank": HEAD_DIM,
    },
    # Sizes under names of one family.
    "mamba2": {"num_heads": 8},  # 8 heads of 8 over the expanded 2 x hidden
    "longcat_flash": {"zero_expert_num": 2},  # identity ("zero") experts besides the 4
    "roc_bert": {
        "pronunciation_embed_dim": HIDDEN,
        "shape_embed_dim": HIDDEN,
        "pronunciation_vocab_size": VOCABULARY,
        "shape_vocab_size": VOCABULARY,
    },
    "cpmant": {"prompt_length": 2, "position_bias_num_buckets": 32},
    "xmod": {"default_language": "en_XX"},  # its adapters need a language
    "xlm": {"causal": True},  # else XLMWithLMHeadModel attends both ways
    "zaya": {"num_experts_per_tok": 1, "router_hidden_size": 16},  # ZAYA routes each token to one expert
    # Wider heads in the full-attention layers (popped by the config's __post_init__).
    **dict.fromkeys(["gemma4_text", "gemma4_unified_text"], {"global_head_dim": 2 * HEAD_DIM}),
    # Its last 10 of 30 layers reuse earlier layers' caches; with 2 layers there is no earlier layer to reuse.
    "gemma3n_text": {"num_kv_shared_layers": 0},
    # Its sliding-window layers take latent-attention sizes of their own from swa_* arguments.
    "dots3_note_text": {
        "swa_num_attention_heads": HEADS,
        "swa_num_key_value_heads": HEADS,
        "swa_head_dim": 12,
        "swa_q_lora_rank": 16,
        "swa_kv_lora_rank": 16,
        "swa_qk_nope_head_dim": 8,
        "swa_v_head_dim": 8,
    },
    "blt": {"encoder_hash_byte_group_vocab": VOCABULARY},  # hashed n-gram embeddings of 500002 rows
    "led": {"attention_window": WINDOW},  # the encoder pads its inputs to a multiple of the window
    # Axial positions: factors of the training sequence length, their widths summing to hidden;
    # attention in chunks of WINDOW; seeded hashing, so that the hashed buckets are reproducible.
    "reformer": {
        "axial_pos_shape": [2, SEQUENCE // 2],
        "axial_pos_embds_dim": [HIDDEN // 2, HIDDEN // 2],
        "local_attn_chunk_length": WINDOW,
        "lsh_attn_chunk_length": WINDOW,
        "num_buckets": 2,
        "hash_seed": SEED,
    },
    # Attention over the concatenated 2 x hidden; its shared block needs two hybrid layers to tie.
    "zamba": {
        "attention_hidden_size": 2 * HIDDEN,
        "attention_head_dim": 2 * HIDDEN // HEADS,
        "layers_block_type": ["hybrid", "hybrid"],
    },
}

#: Multi-head latent attention: as many key/value heads as heads; ``head_dim`` is the rotary part.
_LATENT = {"num_key_value_heads": HEADS, "head_dim": GENERIC["qk_rope_head_dim"]}

#: Attribute names of the layer count, to find the lists with one entry per layer.
_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers")


def _is_dropout(name: str) -> bool:
    """Whether an attribute is a dropout probability (or a layer drop)."""
    return any(word in name for word in ("dropout", "pdrop", "layerdrop", "drop_path"))


def _per_layer(pattern: list[Any]) -> list[Any]:
    """A list with one entry per layer, for ``LAYERS`` layers: its distinct entries, first first.

    ["sliding", "sliding", "full", ...] -> ["sliding", "full"]; ["dense", "sparse", ...] -> ["dense", "sparse"].
    """
    kinds: list[Any] = []
    for entry in pattern:
        if entry not in kinds:
            kinds.append(entry)
    return [kinds[min(i, len(kinds) - 1)] for i in range(LAYERS)]


def tiny_config(
    config_class: type[PretrainedConfig], model_class: type | None = None, **overrides: Any
) -> PretrainedConfig:
    """``config_class`` with its defaults, shrunk (see the module docstring).

    In order: the ``GENERIC`` names, the special tokens, dropouts, sliding windows, the lists with
    one entry per layer, the sub-configs (shrunk the same way), then ``FAMILY[model_type]`` and
    ``overrides``. Only attributes the default config has are set. ``model_class`` (default: the
    base model of the config's model_type) decides between "sdpa" and "eager" attention.
    """
    present = config_class().to_dict()
    changes: dict[str, Any] = {}
    for name, value in present.items():
        if value is None and name in OPTIONAL:
            continue
        if name in GENERIC:
            changes[name] = GENERIC[name]
        elif value is None:
            continue
        elif name in SPECIAL_TOKENS:
            changes[name] = [SPECIAL_TOKENS[name]] if isinstance(value, list) else SPECIAL_TOKENS[name]
        elif name.endswith(("_token_id", "_token_index")) and isinstance(value, int) and value >= VOCABULARY:
            changes[name] = FIRST_TOKEN
        elif _is_dropout(name) and isinstance(value, float):
            changes[name] = 0.0
        elif name in ("sliding_window", "sliding_window_size") and isinstance(value, int):
            changes[name] = WINDOW
    layers = next((present[n] for n in _LAYER_COUNTS if isinstance(present.get(n), int)), None)
    for name, value in present.items():
        if isinstance(value, list) and layers is not None and len(value) == layers > LAYERS:
            per_layer = name in GENERIC and not isinstance(GENERIC[name], list)  # a size per layer
            changes[name] = [GENERIC[name]] * LAYERS if per_layer else _per_layer(value)
    for name, sub_class in getattr(config_class, "sub_configs", {}).items():
        if sub_class.__name__ != "AutoConfig" and isinstance(present.get(name), dict):
            changes[name] = tiny_config(sub_class).to_dict()
    changes["experts_implementation"] = "eager"  # a loop over experts: float64 works, unlike grouped_mm
    changes["attn_implementation"] = _attention(config_class, model_class)
    if "kv_lora_rank" in changes:  # latent attention: every head has its keys, the rotary part is a head's
        changes.update({k: v for k, v in _LATENT.items() if k in present})
    for name, value in {**FAMILY.get(getattr(config_class, "model_type", ""), {}), **overrides}.items():
        merge = isinstance(value, dict) and isinstance(changes.get(name), dict) and name in config_class.sub_configs
        changes[name] = {**changes[name], **value} if merge else value
    return config_class(**changes)


def _attention(config_class: type, model_class: type | None) -> str:
    """ "sdpa" where the model supports it, else "eager"."""
    if model_class is None:
        from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

        name = MODEL_MAPPING_NAMES.get(getattr(config_class, "model_type", ""))
        model_class = _class(name) if isinstance(name, str) else None
    return "sdpa" if model_class is not None and getattr(model_class, "_supports_sdpa", False) else "eager"


def _class(name: str) -> type:
    """A class of transformers by name."""
    return getattr(importlib.import_module("transformers"), name)


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Architecture:
    """One entry: which config and which model class, what kind of loss, any config overrides."""

    model_type: str
    model_class: str
    kind: Kind
    overrides: Mapping[str, Any] = field(default_factory=dict)


def _causal(model_type: str, model_class: str, **overrides: Any) -> Architecture:
    return Architecture(model_type, model_class, "causal", overrides)


def _seq2seq(model_type: str, model_class: str, **overrides: Any) -> Architecture:
    return Architecture(model_type, model_class, "seq2seq", overrides)


def _masked(model_type: str, model_class: str, **overrides: Any) -> Architecture:
    return Architecture(model_type, model_class, "masked", overrides)


FULL_MATRIX: dict[str, Architecture] = {
    # Llama-style decoders: RMSNorm, rotary, SwiGLU, grouped-query attention.
    "llama": _causal("llama", "LlamaForCausalLM"),
    "llama-tied": _causal("llama", "LlamaForCausalLM", tie_word_embeddings=True),
    "mistral": _causal("mistral", "MistralForCausalLM"),
    "ministral": _causal("ministral", "MinistralForCausalLM"),
    "qwen2": _causal("qwen2", "Qwen2ForCausalLM"),
    "qwen3": _causal("qwen3", "Qwen3ForCausalLM"),
    "olmo": _causal("olmo", "OlmoForCausalLM"),
    "olmo2": _causal("olmo2", "Olmo2ForCausalLM"),
    "olmo3": _causal("olmo3", "Olmo3ForCausalLM"),
    "cohere": _causal("cohere", "CohereForCausalLM"),
    "cohere2": _causal("cohere2", "Cohere2ForCausalLM"),
    "stablelm": _causal("stablelm", "StableLmForCausalLM"),
    "granite": _causal("granite", "GraniteForCausalLM"),
    "starcoder2": _causal("starcoder2", "Starcoder2ForCausalLM"),
    "internlm3": _causal("internlm3", "LlamaForCausalLM"),
    "glm": _causal("glm", "GlmForCausalLM"),
    "glm4": _causal("glm4", "Glm4ForCausalLM"),
    "llama4_text": _causal("llama4_text", "Llama4ForCausalLM"),
    "smollm3": _causal("smollm3", "SmolLM3ForCausalLM"),
    "helium": _causal("helium", "HeliumForCausalLM"),
    "exaone4": _causal("exaone4", "Exaone4ForCausalLM"),
    "ernie4_5": _causal("ernie4_5", "Ernie4_5ForCausalLM"),
    "seed_oss": _causal("seed_oss", "SeedOssForCausalLM"),
    "nemotron": _causal("nemotron", "NemotronForCausalLM"),
    "persimmon": _causal("persimmon", "PersimmonForCausalLM"),
    "phi": _causal("phi", "PhiForCausalLM"),
    "phi3": _causal("phi3", "Phi3ForCausalLM"),
    # Norms with offsets (1 + weight), scaled embeddings, soft-capping, sliding windows.
    "gemma": _causal("gemma", "GemmaForCausalLM"),
    "gemma2": _causal("gemma2", "Gemma2ForCausalLM"),
    "gemma3_text": _causal("gemma3_text", "Gemma3ForCausalLM"),
    # Fused interleaved q/k/v, parallel attention and MLP.
    "falcon": _causal("falcon", "FalconForCausalLM"),
    "falcon-40b": _causal("falcon", "FalconForCausalLM", new_decoder_architecture=True),  # grouped q/k/v
    "gpt_neox": _causal("gpt_neox", "GPTNeoXForCausalLM"),
    # GPT-2 lineage: Conv1D, learned positions, tied LM head.
    "gpt2": _causal("gpt2", "GPT2LMHeadModel"),
    "gpt_bigcode": _causal("gpt_bigcode", "GPTBigCodeForCausalLM"),
    "gptj": _causal("gptj", "GPTJForCausalLM"),
    "gpt_neo": _causal("gpt_neo", "GPTNeoForCausalLM"),
    "codegen": _causal("codegen", "CodeGenForCausalLM"),
    "opt": _causal("opt", "OPTForCausalLM"),
    "bloom": _causal("bloom", "BloomForCausalLM"),
    "mpt": _causal("mpt", "MptForCausalLM"),
    "xglm": _causal("xglm", "XGLMForCausalLM"),
    # Mixtures of experts.
    "mixtral": _causal("mixtral", "MixtralForCausalLM"),
    "qwen2_moe": _causal("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3_moe": _causal("qwen3_moe", "Qwen3MoeForCausalLM"),
    "olmoe": _causal("olmoe", "OlmoeForCausalLM"),
    "phimoe": _causal("phimoe", "PhimoeForCausalLM"),
    "granitemoe": _causal("granitemoe", "GraniteMoeForCausalLM"),
    "dbrx": _causal("dbrx", "DbrxForCausalLM"),
    "gpt_oss": _causal("gpt_oss", "GptOssForCausalLM"),
    "deepseek_v2": _causal("deepseek_v2", "DeepseekV2ForCausalLM"),
    "deepseek_v3": _causal("deepseek_v3", "DeepseekV3ForCausalLM"),
    "glm4_moe": _causal("glm4_moe", "Glm4MoeForCausalLM"),
    # Hybrid: gated delta-net linear attention and full attention, mixture of experts.
    "qwen3_next": _causal("qwen3_next", "Qwen3NextForCausalLM"),
    # Encoder-decoder.
    "t5": _seq2seq("t5", "T5ForConditionalGeneration"),
    "mt5": _seq2seq("mt5", "MT5ForConditionalGeneration"),
    "umt5": _seq2seq("umt5", "UMT5ForConditionalGeneration"),
    "bart": _seq2seq("bart", "BartForConditionalGeneration"),
    "mbart": _seq2seq("mbart", "MBartForConditionalGeneration"),
    "pegasus": _seq2seq("pegasus", "PegasusForConditionalGeneration"),
    "marian": _seq2seq("marian", "MarianMTModel"),
    "m2m_100": _seq2seq("m2m_100", "M2M100ForConditionalGeneration"),
    # Masked LM (encoders).
    "bert": _masked("bert", "BertForMaskedLM"),
    "roberta": _masked("roberta", "RobertaForMaskedLM"),
    "xlm-roberta": _masked("xlm-roberta", "XLMRobertaForMaskedLM"),
    "distilbert": _masked("distilbert", "DistilBertForMaskedLM"),
    "deberta-v2": _masked("deberta-v2", "DebertaV2ForMaskedLM"),
    "modernbert": _masked("modernbert", "ModernBertForMaskedLM"),
}

#: Model types of the causal-LM and sequence-to-sequence mappings left out of ``SWEEP``, with why.
SKIPPED: dict[str, str] = {
    # Not text-only: vision, audio or speech inputs (where a text-only model type exists, it is named).
    **{
        model_type: f"multimodal (vision); its text model is {text}"
        for model_type, text in [
            ("gemma3", "gemma3_text"),
            ("llama4", "llama4_text"),
            ("qwen3_5", "qwen3_5_text"),
            ("qwen3_5_moe", "qwen3_5_moe_text"),
            ("qwen4_exp", "qwen4_exp_text"),
        ]
    },
    **{
        model_type: f"multimodal (vision, audio); its text model is {text}"
        for model_type, text in [
            ("gemma3n", "gemma3n_text"),
            ("gemma4", "gemma4_text"),
            ("gemma4_unified", "gemma4_unified_text"),
            ("dots3_note", "dots3_note_text"),
        ]
    },
    **dict.fromkeys(["fuyu", "git", "got_ocr2", "t5gemma2"], "multimodal (vision)"),
    "mllama": "multimodal (vision): its text model has cross-attention layers to image states",
    "emu3": "multimodal (images as VQ-VAE tokens)",
    "phi4_multimodal": "multimodal (vision, audio)",
    **dict.fromkeys(
        [
            "audioflamingo3",
            "glmasr",
            "granite_speech",
            "granite_speech_plus",
            "moss_transcribe_diarize",
            "musicflamingo",
            "nemo_speechlm",
            "qwen2_audio",
            "qwen3_asr",
            "vibevoice_asr",
            "voxtral",
            "voxtral_realtime",
        ],
        "speech (audio encoder and text decoder)",
    ),
    **dict.fromkeys(["moshi", "musicgen", "musicgen_melody"], "audio: decodes audio codebooks"),
    # Text-only, but not one model.
    "encoder-decoder": "EncoderDecoderModel composes any two models (bert, gpt2, ... are covered on their own)",
    **dict.fromkeys(
        ["gemma4_assistant", "gemma4_unified_assistant"],
        "speculative-decoding drafter: needs the hidden states of its target model",
    ),
}

#: Causal entries that attend to later tokens too, so that the next-token loss sees its targets (the
#: comparison with one process holds all the same).
SEES_AHEAD: dict[str, str] = {
    "xlnet": "a permutation LM: XLNetLMHeadModel is causal only under a perm_mask and target_mapping",
    "cpmant": "CpmAntForCausalLM marks every given token as context, which attends both ways",
}

#: Architectures that cannot run in float64 -> why; they run in float32.
FLOAT32: dict[str, str] = {
    "xglm": "its eager attention clamps with torch.full((), finfo(float64).min) in the default float32: overflow",
    "fsmt": "its causal mask fills a float32 copy with finfo(float64).min: overflow",
    "inkling2_text": "its router casts the hidden states to float32 against the float64 router weight",
}


def _sweep() -> dict[str, Architecture]:
    """Every causal-LM and seq2seq model type of the auto mappings not in FULL_MATRIX nor SKIPPED."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    covered = {entry.model_type for entry in FULL_MATRIX.values()} | set(SKIPPED)
    sweep: dict[str, Architecture] = {}
    for mapping, kind in (
        (MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, "seq2seq"),
        (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "causal"),
    ):
        for model_type, model_class in mapping.items():
            if model_type not in covered and model_type not in sweep and isinstance(model_class, str):
                sweep[model_type] = Architecture(model_type, model_class, kind)  # type: ignore[arg-type]
    return dict(sorted(sweep.items()))


SWEEP: dict[str, Architecture] = _sweep()
ALL: dict[str, Architecture] = {**FULL_MATRIX, **SWEEP}


# --------------------------------------------------------------------------------------------
# Models, batches, losses
# --------------------------------------------------------------------------------------------


def config(name: str) -> PretrainedConfig:
    """The tiny config of an entry of ``ALL``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    entry = ALL[name]
    overrides = dict(entry.overrides)
    if entry.kind == "causal" and "is_decoder" in CONFIG_MAPPING[entry.model_type]().to_dict():
        overrides.setdefault("is_decoder", True)  # encoders as decoders (BertLMHeadModel, ...): causal masks
    return tiny_config(CONFIG_MAPPING[entry.model_type], _class(entry.model_class), **overrides)


def dtype(name: str) -> torch.dtype:
    """float64, or float32 for the architectures of ``FLOAT32``."""
    return torch.float32 if name in FLOAT32 else torch.float64


def build(name: str) -> nn.Module:
    """The model of an entry of ``ALL``: seeded random weights, in ``dtype(name)``, train mode."""
    entry = ALL[name]
    torch.manual_seed(SEED)
    model = _class(entry.model_class)(config(name))
    return model.to(dtype(name)).train()


def parameter_count(name: str) -> int:
    """The number of parameters of an entry of ``ALL``, built on the meta device (nothing allocated)."""
    entry = ALL[name]
    with torch.device("meta"):
        model = _class(entry.model_class)(config(name))
    return sum(p.numel() for p in model.parameters())


def batch(name: str, step: int) -> dict[str, torch.Tensor]:
    """The tensors of one training step: ``input_ids`` [BATCH, SEQUENCE], and per kind of model:

    causal: nothing more (the targets are the next tokens); seq2seq: ``labels`` and the
    ``decoder_input_ids`` (labels shifted right after ``DECODER_START``); masked: ``labels``
    (the original token where ``input_ids`` holds ``MASK``, -100 elsewhere).
    """
    kind = ALL[name].kind
    generator = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(FIRST_TOKEN, VOCABULARY, (BATCH, SEQUENCE), generator=generator)
    if kind == "causal":
        return {"input_ids": ids}
    if kind == "seq2seq":
        labels = torch.randint(FIRST_TOKEN, VOCABULARY, (BATCH, SEQUENCE), generator=generator)
        start = torch.full((BATCH, 1), DECODER_START)
        return {"input_ids": ids, "decoder_input_ids": torch.cat([start, labels[:, :-1]], 1), "labels": labels}
    rows, columns = torch.meshgrid(torch.arange(BATCH), torch.arange(SEQUENCE), indexing="ij")
    masked = (rows + columns + step) % 4 == 0
    return {"input_ids": ids.masked_fill(masked, MASK), "labels": ids.masked_fill(~masked, -100)}


def forward(model: nn.Module, inputs: Mapping[str, torch.Tensor]) -> Any:
    """The model on a batch; ``labels`` are the loss's, not the model's."""
    return model(**{key: value for key, value in inputs.items() if key != "labels"})


def loss(outputs: Any, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of ``outputs.logits``: of the next token where there are no ``labels``, else of the labels."""
    logits = outputs.logits
    if "labels" in inputs:
        targets = inputs["labels"]
    else:
        logits, targets = logits[:, :-1], inputs["input_ids"][:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --------------------------------------------------------------------------------------------
# The check: python -m tests.zoo.architectures [NAME ...]
# --------------------------------------------------------------------------------------------


def train(name: str, steps: int = 2) -> tuple[list[float], int]:
    """Build ``name`` and train it ``steps`` AdamW steps in this process: its losses and parameter count."""
    count = parameter_count(name)
    if count > MAX_PARAMETERS:
        raise ValueError(f"{count} parameters: not tiny, the shrinker missed an attribute")
    model = build(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        inputs = batch(name, step)
        value = loss(forward(model, inputs), inputs)
        if not torch.isfinite(value):
            raise FloatingPointError(f"loss {value.item()} at step {step}")
        value.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(value.item())
    return losses, sum(p.numel() for p in model.parameters())


def _main(names: list[str]) -> int:
    import time
    import warnings

    from transformers.utils import logging

    logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    failures = 0
    start = time.perf_counter()
    for name in names or list(ALL):
        began = time.perf_counter()
        try:
            losses, count = train(name)
            result = f"ok  {ALL[name].kind:7s} {dtype(name)} losses {losses[0]:.4f} {losses[1]:.4f}"
        except Exception as error:  # reported: one line per architecture
            failures += 1
            count = 0
            message = " ".join(str(error).split())[:240]
            result = f"FAIL {type(error).__name__}: {message}"
        table = "full " if name in FULL_MATRIX else "sweep"
        print(f"{table} {name:28s} {count:9d} {time.perf_counter() - began:6.2f}s {result}", flush=True)
    print(f"{len(names or ALL)} architectures, {failures} failed, {time.perf_counter() - start:.1f}s in all")
    return 1 if failures else 0


if __name__ == "__main__":
    import sys

    raise SystemExit(_main(sys.argv[1:]))
