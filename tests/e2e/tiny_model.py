"""A tiny Llama for real `vllm serve` runs, made here: no download.

Random weights from a fixed seed (4 layers, hidden 256, 4 heads, 2 KV heads,
head_dim 64, vocabulary 4096, bf16) and a byte-level BPE tokenizer trained on
text generated from the same seed, saved as a PreTrainedTokenizerFast with a
chat template. The weights are noise, so outputs are gibberish; what the
end-to-end tests compare is that two ways of serving one prompt give the same
tokens and logprobs, which needs only a real forward pass.

The model is cached outside the clone, keyed by this file's hash
(model_dir()): a change here makes a new one. Run alone to (re)make one:

    python tests/e2e/tiny_model.py [OUT_DIR]
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

SEED = 20261201
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, FFN = 4, 256, 4, 2, 64, 4096, 512
MAX_POSITIONS = 16384
# Weight scale: large enough that the logits are not flat (greedy argmax far
# from ties), small enough that 4 layers stay finite in bf16.
STD = 0.05
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
# One message per line pair; the generation prompt ends with "assistant\n".
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def _key() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def model_dir() -> Path:
    """The cached model's directory, made on first use (atomic rename, so a
    concurrent or killed maker leaves nothing half-written under this name)."""
    cache = Path(os.environ.get("KVSHIM_CACHE", Path.home() / ".cache" / "kvshim"))
    out = cache / f"e2e-tiny-llama-{_key()}"
    if (out / "config.json").exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".build-", dir=cache))
    tmp.chmod(0o755)  # mkdtemp makes it 0700
    try:
        make(tmp)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "config.json").exists():  # not a concurrent maker's
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def corpus(n_words: int = 60000) -> list[str]:
    """Deterministic text: words of 1-4 syllables in lines of 8-20 words,
    with digits and punctuation so the tokenizer learns more than letters."""
    rng = random.Random(SEED)
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "tr", "ch", "sh"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ee"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st"]
    lexicon = sorted({"".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                              for _ in range(rng.randint(1, 4))) for _ in range(6000)})
    lines, line = [], []
    for _ in range(n_words):
        w = rng.choice(lexicon)
        r = rng.random()
        if r < 0.03:
            w = str(rng.randint(0, 9999))
        elif r < 0.06:
            w = w.capitalize()
        line.append(w)
        if len(line) >= rng.randint(8, 20):
            lines.append(" ".join(line) + rng.choice([".", ",", "?", "!", ";", ":"]))
            line = []
    return lines


def make(out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[BOS, EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = MAX_POSITIONS
    fast.save_pretrained(out)

    g = torch.Generator().manual_seed(SEED)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * STD).to(torch.bfloat16)

    ones = torch.ones(HIDDEN, dtype=torch.bfloat16)
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": w(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = w(HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.k_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.v_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.o_proj.weight"] = w(HIDDEN, HEADS * HEAD_DIM)
        t[p + "mlp.gate_proj.weight"] = w(FFN, HIDDEN)
        t[p + "mlp.up_proj.weight"] = w(FFN, HIDDEN)
        t[p + "mlp.down_proj.weight"] = w(HIDDEN, FFN)
        t[p + "input_layernorm.weight"] = ones.clone()
        t[p + "post_attention_layernorm.weight"] = ones.clone()
    t["model.norm.weight"] = ones.clone()
    t["lm_head.weight"] = w(VOCAB, HIDDEN)
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})

    ids = {s: tok.token_to_id(s) for s in (BOS, EOS, PAD)}
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "vocab_size": VOCAB, "max_position_embeddings": MAX_POSITIONS, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": ids[BOS], "eos_token_id": ids[EOS],
        "pad_token_id": ids[PAD], "attention_bias": False, "mlp_bias": False,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]}) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        d = Path(sys.argv[1])
        d.mkdir(parents=True, exist_ok=True)
        make(d)
    else:
        d = model_dir()
    print(d)
