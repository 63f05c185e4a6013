"""The tiny model both runs load (config and tokenizer files, no download) and the prompts
each rank generates from."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
_WORDS_TEXT = (
    "the a an of to in on at for with from by and or but not is are was were be been this that "
    "these those it its they them we you he she one two three four five six seven eight nine ten "
    "red green blue black white small large fast slow old new good bad first last next other "
    "cat dog bird fish tree river stone cloud rain sun moon star city road house door window "
    "table chair book page word line number letter model token batch rank step graph padding "
    "engine server client round group value result error time day night year world water fire"
)
WORDS = _WORDS_TEXT.split()
#: Fixed prompts (greedy decoding, so the tokens are deterministic); ranks take turns.
PROMPTS = [
    "the cat sat on the old stone by the river",
    "one two three four five",
    "a small red bird and a large blue fish",
    "the engine runs a batch of tokens in one step",
    "every rank of the group reads the same value",
    "rain and sun over the city at night",
    "the first page of the book has one word",
    "a fast dog and a slow cat",
]


def vocabulary(size: int = 512) -> list[str]:
    """The tiny tokenizer's tokens: specials, the prompt words, then fillers up to `size`."""
    prompt_words = [w for p in PROMPTS for w in p.split()]
    tokens = [*SPECIALS, *dict.fromkeys([*WORDS, *prompt_words])]
    tokens += [f"w{i:03d}" for i in range(size - len(tokens))]
    assert len(tokens) == size and len(set(tokens)) == size
    return tokens


def tokenizer_json(vocab: Sequence[str]) -> dict[str, Any]:
    """A `tokenizers` file (tokenizer.json): word level, split on whitespace, words joined by
    spaces on decode. Written as data, so building it needs no package; vLLM loads it through
    transformers' PreTrainedTokenizerFast."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, t in enumerate(SPECIALS)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},
        "model": {
            "type": "WordLevel",
            "vocab": {t: i for i, t in enumerate(vocab)},
            "unk_token": "<unk>",
        },
    }


def model_config(vocab_size: int, moe: bool = False) -> dict[str, Any]:
    """A tiny Llama declared MoE (see the module docstring), or with `moe` a tiny Mixtral."""
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "torch_dtype": "bfloat16",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }
    if moe:
        return {
            **common,
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "sliding_window": None,
            "router_aux_loss_coef": 0.0,
        }
    return {
        **common,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "mlp_bias": False,
    }


def write_tiny_model(directory: Path, moe: bool = False) -> Path:
    """Write the model directory vLLM loads with `load_format="dummy"`: config.json,
    generation_config.json and the tokenizer files. Returns `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = vocabulary()
    files: dict[str, Any] = {
        "config.json": model_config(len(vocab), moe),
        "generation_config.json": {
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 3,
            "do_sample": False,
        },
        "tokenizer.json": tokenizer_json(vocab),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": 512,
            "unk_token": "<unk>",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
        },
        "special_tokens_map.json": {
            "unk_token": "<unk>",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
        },
    }
    for name, content in files.items():
        (directory / name).write_text(json.dumps(content, indent=1) + "\n")
    return directory


def prompts_for(rank: int, dp: int, prompts: Sequence[str] = PROMPTS) -> list[str]:
    """Rank r takes prompts r, r+dp, ...: uneven lengths per rank, so DP padding matters."""
    return list(prompts[rank::dp])
