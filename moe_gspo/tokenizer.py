"""The shipped character-level tokenizer used by the tiny CPU configs and the synthetic tasks.

It is a real `tokenizers` WordLevel tokenizer wrapped in `PreTrainedTokenizerFast`, saved under
`moe_gspo/assets/tiny_tokenizer/` so nothing is fetched from a model hub. Regenerate it with
`python -m moe_gspo.tokenizer` (the vocabulary below is the single source of truth).
"""

from __future__ import annotations

import os
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]
CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz+-*=:;,.?! ")
ASSET_DIR = Path(__file__).parent / "assets" / "tiny_tokenizer"


def build_tiny_tokenizer():
    """Build the character-level tokenizer from scratch (no files needed)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        padding_side="left",
    )


def load_tiny_tokenizer():
    """Load the shipped tokenizer (falls back to building it if the asset is missing)."""
    from transformers import AutoTokenizer

    if (ASSET_DIR / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(ASSET_DIR))
    return build_tiny_tokenizer()


def save_tiny_tokenizer(out_dir: str | os.PathLike = ASSET_DIR) -> None:
    build_tiny_tokenizer().save_pretrained(str(out_dir))


if __name__ == "__main__":
    save_tiny_tokenizer()
    print(f"wrote {ASSET_DIR}")
