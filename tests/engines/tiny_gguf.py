"""A tiny, deterministic llama-architecture GGUF for tests: random weights (seeded), a byte-level
SentencePiece vocabulary, a few hundred KiB. It loads in llama.cpp's llama-server and generates
tokens (nonsense, but the engine's own), which is what the real-engine tests need: a real load
phase, a real stream, real /metrics. Written with the `gguf` package (llama.cpp's own writer).

    python -m tests.engines.tiny_gguf OUT.gguf
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

# Small enough to load in well under a second on one core, large enough to be a real transformer:
# two blocks, four heads (two KV heads: grouped-query attention, as in current models).
N_EMBD = 64
N_LAYERS = 2
N_HEAD = 4
N_HEAD_KV = 2
N_FF = 128
N_CTX = 16384  # per slot: this divided by --parallel
SEED = 20261207

SPECIALS = ["<unk>", "<s>", "</s>"]
UNK, BOS, EOS = 0, 1, 2
# Every byte as its own token (<0x00> .. <0xFF>), so any text tokenizes, plus whole words, so the
# tokenizer's merge path is used too and what the model says reads as (random) words.
WORDS = ("the a an and of to in is it that on for with as at by from this be are was or not but we you they "
         "model cold warm start token stream wake idle light fast slow small large graph node pod queue cache "
         "hello world again answer river stone cloud paper window garden music signal yellow green quiet").split()
PIECES = ["▁", *(f"▁{w}" for w in WORDS), "ing", "ed", "s", "."]
# A constant dimension of the residual stream (no block writes to it) lets the output layer give every
# token a fixed bias: control tokens and non-ASCII bytes are never sampled, words are preferred, so
# the random model streams readable (meaningless) text.
BIAS_DIM = 0
BIAS_VALUE = 4.0


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    from gguf import TokenType

    tokens = list(SPECIALS)
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    tokens += PIECES
    types += [TokenType.NORMAL] * len(PIECES)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(PIECES))]
    return tokens, scores, [int(t) for t in types]


def _bias(token: str) -> float:
    """The output bias (times the normalised BIAS_VALUE): words up, ASCII bytes neutral, the rest out."""
    if token.startswith("▁") and len(token) > 1:
        return 0.5
    if token.startswith("<0x") and int(token[3:5], 16) in range(0x20, 0x7F):
        return -0.5
    if token in SPECIALS or token.startswith("<0x"):
        return -40.0
    return 0.0


def _not_into_bias(matrix: np.ndarray) -> np.ndarray:
    matrix[BIAS_DIM, :] = 0.0  # rows are outputs: nothing is added to the bias dimension
    return matrix


def write(path: Path) -> Path:
    import numpy as np
    from gguf import GGUFWriter

    rng = np.random.default_rng(SEED)
    tokens, scores, types = vocabulary()
    n_vocab = len(tokens)
    head_dim = N_EMBD // N_HEAD

    def weights(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    writer = GGUFWriter(str(path), "llama")
    writer.add_name("noctaya-tiny")
    writer.add_context_length(N_CTX)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYERS)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(0)  # all F32
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(UNK)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    # numpy shapes are (rows, cols) = GGUF's (ne1, ne0): a weight mapping n_in -> n_out is (n_out, n_in).
    embeddings = weights(n_vocab, N_EMBD)
    embeddings[:, BIAS_DIM] = BIAS_VALUE
    output = weights(n_vocab, N_EMBD)
    output[:, BIAS_DIM] = [_bias(token) for token in tokens]
    writer.add_tensor("token_embd.weight", embeddings)
    writer.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    writer.add_tensor("output.weight", output)
    for i in range(N_LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", weights(N_EMBD, N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weights(N_HEAD_KV * head_dim, N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weights(N_HEAD_KV * head_dim, N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_output.weight", _not_into_bias(weights(N_EMBD, N_EMBD)))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weights(N_FF, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weights(N_FF, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", _not_into_bias(weights(N_EMBD, N_FF)))
    path.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


if __name__ == "__main__":
    out = write(Path(sys.argv[1]))
    print(f"{out}: {out.stat().st_size} bytes")
