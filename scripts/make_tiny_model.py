"""Make a tiny Llama checkpoint locally (no model hub): random weights from a fixed seed, a byte-level
BPE tokenizer trained here with ``tokenizers``, and a chat template. vLLM loads it in seconds on CPU.

    python scripts/make_tiny_model.py DIR [--moe] [--seed N]   # idempotent: a complete DIR is left as it is

Shape: hidden 64, 2 layers, 2 attention heads (head size 32: a size vLLM's CPU attention supports),
1 KV head, vocabulary ~400. ``--moe``: a tiny Mixtral instead (4 experts, top 2 per token, same
tokenizer), for routed experts. ``--seed``: other random weights with the same shape and tokenizer
(a second policy version for weight-reload tests). Needs ``transformers``, ``tokenizers`` and
``torch`` (the engines venv).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

SEED = 1234
VOCAB_SIZE = 400
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
STAMP = "tiny_model.json"
VERSION = 1  # bump when the recipe changes: existing directories are then rebuilt


def _corpus() -> list[str]:
    """A fixed training text: arithmetic chat turns and robot instructions."""
    words = ["pick", "place", "the", "cup", "block", "red", "blue", "green", "on", "table", "drawer",
             "open", "close", "move", "left", "right", "up", "down", "yes", "no", "try", "again",
             "what", "is", "answer", "turn", "robot", "arm", "gripper", "camera"]
    lines = []
    for i in range(400):
        a, b = i % 17, (i * 7) % 13
        lines.append(f"what is {a} + {b}? the answer is {a + b}.")
        lines.append(" ".join(words[(i * k) % len(words)] for k in range(1, 9)))
        lines.append(f"turn {i % 10}: no, try again")
    return lines


def _recipe(moe: bool = False, seed: int = SEED) -> dict[str, object]:
    recipe: dict[str, object] = {"version": VERSION, "seed": seed, "vocab_size": VOCAB_SIZE, "hidden_size": 64,
                                 "layers": 2, "heads": 2, "kv_heads": 1}
    if moe:
        recipe.update(arch="mixtral", experts=4, top_k=2)
    return recipe


def is_complete(path: Path, moe: bool = False, seed: int = SEED) -> bool:
    stamp = path / STAMP
    if not stamp.is_file():
        return False
    try:
        return bool(json.loads(stamp.read_text()) == _recipe(moe, seed))
    except ValueError:
        return False


def _train_tokenizer(out: Path) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def make(path: Path, moe: bool = False, seed: int = SEED) -> Path:
    """Create the model in ``path`` unless a complete one is there already."""
    if is_complete(path, moe, seed):
        return path
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-model-", dir=path.parent))
    try:
        tokenizer = _train_tokenizer(tmp)
        common = dict(
            vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,  # type: ignore[arg-type]
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=2048,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
            pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
            initializer_range=0.2, torch_dtype="float32",
        )
        torch.manual_seed(seed)
        if moe:
            config = MixtralConfig(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, **common)
            model = MixtralForCausalLM(config).to(torch.float32)
        else:
            config = LlamaConfig(intermediate_size=128, **common)
            model = LlamaForCausalLM(config).to(torch.float32)
        model.save_pretrained(tmp, safe_serialization=True)
        GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                         pad_token_id=config.pad_token_id).save_pretrained(tmp)
        (tmp / STAMP).write_text(json.dumps(_recipe(moe, seed)))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--moe", action="store_true", help="a tiny Mixtral (routed experts) instead of Llama")
    parser.add_argument("--seed", type=int, default=SEED, help="the weights' random seed")
    args = parser.parse_args(argv)
    print(make(args.directory, moe=args.moe, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
