"""Makes the tiny model the real-vLLM tests serve: offline, deterministic to the byte.

A Llama with random weights (hidden 128, 2 layers, 2 heads, vocab 512, float32, ~1.8 MB) and a
byte-level BPE tokenizer trained here with `tokenizers` on a fixed text. Its answers are
nonsense, but at temperature 0 they are the same on every run and every engine: exactly what a
failover test needs to compare an answer before and after.

    python make_model.py OUT_DIR
"""

import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 512
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A shadow engine sleeps until the primary dies, then it wakes and serves.",
    "Fencing is the death of the old engine's whole process tree.",
    "Hello, world! How are you today? I am fine, thank you.",
    "0123456789 + - * / = ( ) [ ] { } < > : ; , . ! ? ' \" @ # $ % ^ & _ | ~",
] * 40
# A minimal chat template: vLLM's /v1/chat/completions needs one (transformers >= 4.44 has no
# default).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main(out: str) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer().save_pretrained(out)
    print(f"make_model: wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_model.py OUT_DIR")
    main(sys.argv[1])
