"""Writes a small llama-architecture GGUF model with random weights.

Run by `cargo xtask setup` with the venv's Python: `python llama_model.py OUT`.
Its text is gibberish; its compute and its prompt cache are real, which is
all the router's tests and benchmarks need. Deterministic (fixed seed), so
every machine serves the same model.

Shape (about 110 MB, F32): 512 wide, 8 layers, 8 heads, 1408 FFN, a context
of 8192 tokens. On this project's 2-vCPU VM a 1.7k-token prompt took about
1.3 s to prefill on 2 threads, 70 ms when cached.

Vocabulary: SentencePiece-style (`llama` tokenizer model) with byte fallback:
<unk>, <s>, </s>, two ChatML control tokens, the 256 byte tokens, then
printable characters, `\u2581`-prefixed characters and letter pairs, so
English text is about 2 characters per token.
"""

import string
import sys

import numpy as np
import gguf

N_EMBD = 512
N_LAYER = 8
N_HEAD = 8
N_HEAD_KV = 8
N_FF = 1408
N_CTX = 8192
SEED = 14

# ChatML: what llama-server renders with --jinja.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def vocab():
    tokens, scores, types = [], [], []

    def add(piece, score, kind):
        tokens.append(piece)
        scores.append(score)
        types.append(kind)

    add("<unk>", 0.0, gguf.TokenType.UNKNOWN)
    add("<s>", 0.0, gguf.TokenType.CONTROL)
    add("</s>", 0.0, gguf.TokenType.CONTROL)
    add("<|im_start|>", 0.0, gguf.TokenType.CONTROL)
    add("<|im_end|>", 0.0, gguf.TokenType.CONTROL)
    for b in range(256):
        add("<0x%02X>" % b, 0.0, gguf.TokenType.BYTE)
    space = "\u2581"
    chars = [c for c in string.printable if c not in " \t\n\r\x0b\x0c"]
    seen = set()

    def normal(piece, score):
        if piece not in seen:
            seen.add(piece)
            add(piece, score, gguf.TokenType.NORMAL)

    normal(space, -1.0)
    for c in chars:
        normal(c, -2.0)
        normal(space + c, -1.5)
    letters = string.ascii_lowercase
    for a in letters:
        for b in letters:
            normal(a + b, -3.0)
            normal(space + a + b, -2.5)
    return tokens, scores, types


def main(out):
    rng = np.random.default_rng(SEED)
    tokens, scores, types = vocab()
    n_vocab = len(tokens)

    w = gguf.GGUFWriter(out, "llama")
    w.add_name("prefix-router tiny random llama")
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(4)  # <|im_end|> ends a turn
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)

    ones = np.ones(N_EMBD, dtype=np.float32)
    # numpy shapes are (rows, cols) = ggml's ne reversed.
    w.add_tensor("token_embd.weight", mat(n_vocab, N_EMBD))
    kv = N_EMBD // N_HEAD * N_HEAD_KV
    for i in range(N_LAYER):
        p = "blk.%d." % i
        w.add_tensor(p + "attn_norm.weight", ones)
        w.add_tensor(p + "attn_q.weight", mat(N_EMBD, N_EMBD))
        w.add_tensor(p + "attn_k.weight", mat(kv, N_EMBD))
        w.add_tensor(p + "attn_v.weight", mat(kv, N_EMBD))
        w.add_tensor(p + "attn_output.weight", mat(N_EMBD, N_EMBD))
        w.add_tensor(p + "ffn_norm.weight", ones)
        w.add_tensor(p + "ffn_gate.weight", mat(N_FF, N_EMBD))
        w.add_tensor(p + "ffn_up.weight", mat(N_FF, N_EMBD))
        w.add_tensor(p + "ffn_down.weight", mat(N_EMBD, N_FF))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", mat(n_vocab, N_EMBD))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main(sys.argv[1])
