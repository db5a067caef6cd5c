"""The models the peers build, by zeroflow's shape names: GPT-2 sizes as `GPT2LMHeadModel`, Llama
sizes as `LlamaForCausalLM` (the shapes of zeroflow's `llama-1b`, `llama-3b` and `llama-8b`), each
randomly initialised with sdpa attention and no dropout. Shared by gpt_fwd_bwd.py and ds_train.py."""

GPT2_SIZES = {
    # name: (n_layer, d_model, n_head, vocab, context)
    "gpt2-124m": (12, 768, 12, 50304, 1024),
    "gpt2-350m": (24, 1024, 16, 50304, 1024),
    "gpt2-774m": (36, 1280, 20, 50304, 1024),
    "gpt-1.3b": (24, 2048, 16, 50304, 1024),
    "gpt2-1.5b": (48, 1600, 25, 50304, 1024),
}

LLAMA_SIZES = {
    # name: (layers, hidden, heads, kv heads, intermediate, vocab, tied)
    "llama-1b": (16, 2048, 32, 8, 8192, 128256, True),
    "llama-3b": (28, 3072, 24, 8, 8192, 128256, True),
    "llama-8b": (32, 4096, 32, 8, 14336, 128256, False),
}

NAMES = sorted(GPT2_SIZES) + sorted(LLAMA_SIZES)


def gpt2_config(n_layer, d, n_head, vocab, context):
    from transformers import GPT2Config
    return GPT2Config(
        n_layer=n_layer, n_embd=d, n_head=n_head, vocab_size=vocab, n_positions=context,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="sdpa",
    )


def llama_config(name, context, shape=None):
    """The LlamaConfig of a named shape, or of `shape` = (layers, hidden, heads, kv heads,
    intermediate, vocab, tied)."""
    from transformers import LlamaConfig
    layers, hidden, heads, kv_heads, ffn, vocab, tied = shape or LLAMA_SIZES[name]
    return LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=ffn, vocab_size=vocab,
        tie_word_embeddings=tied, rope_theta=500000.0, max_position_embeddings=max(context, 2048),
        rms_norm_eps=1e-5, attention_dropout=0.0, attn_implementation="sdpa",
    )


def build(name, context=1024, custom=None, llama=None):
    """The model of a named shape (or of `custom` = (n_layer, d, n_head, vocab, context), a GPT-2,
    or of `llama` = a Llama shape as LLAMA_SIZES holds them), on the current default device, and
    its vocabulary size."""
    from transformers import GPT2LMHeadModel, LlamaForCausalLM
    if llama is not None:
        return LlamaForCausalLM(llama_config(None, context, llama)), llama[5]
    if custom is not None:
        return GPT2LMHeadModel(gpt2_config(*custom)), custom[3]
    if name in LLAMA_SIZES:
        return LlamaForCausalLM(llama_config(name, context)), LLAMA_SIZES[name][5]
    return GPT2LMHeadModel(gpt2_config(*GPT2_SIZES[name])), GPT2_SIZES[name][3]
