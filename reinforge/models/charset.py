"""The fixed alphabet of the built-in character-level tokenizer.

Kept in its own module (no torch, no transformers) so that tasks can check
that every prompt and completion they produce is representable.
"""

# Order matters: token ids are positions in SPECIAL_TOKENS + CHARSET.
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
CHARSET = (
    "0123456789"
    "abcdefghijklmnopqrstuvwxyz"
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    " +-*/()=:,.?!<>_[]{}'\"|\n"
)
