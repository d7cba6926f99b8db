"""Make a tiny Llama checkpoint locally (no model hub): random weights from a fixed seed, a byte-level
BPE tokenizer trained here with ``tokenizers``, and a chat template. vLLM loads it in seconds on CPU.

    python scripts/make_tiny_model.py DIR [--moe | --llava] [--seed N]   # idempotent

Shape: hidden 64, 2 layers, 2 attention heads (head size 32: a size vLLM's CPU attention supports),
1 KV head, vocabulary ~400. ``--moe``: a tiny Mixtral instead (4 experts, top 2 per token, same
tokenizer), for routed experts. ``--llava``: a tiny LLaVA (a CLIP vision tower on 32x32 images, 4
image tokens per image, the tokenizer plus an ``<image>`` token, a chat template that takes image
parts), for multimodal token steps. ``--seed``: other random weights with the same shape and
tokenizer (a second policy version for weight-reload tests). Needs ``transformers``, ``tokenizers``
and ``torch`` (the engines venv).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

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
# Image parts become one <image> token each; the processor expands it to the image's tokens.
LLAVA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<image>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
IMAGE_TOKEN = "<image>"
IMAGE_SIZE, PATCH_SIZE = 32, 16  # (32 / 16) ** 2 = 4 image tokens per image
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


ARCHS = ("llama", "mixtral", "llava")


def _recipe(arch: str = "llama", seed: int = SEED) -> dict[str, object]:
    recipe: dict[str, object] = {"version": VERSION, "seed": seed, "vocab_size": VOCAB_SIZE, "hidden_size": 64,
                                 "layers": 2, "heads": 2, "kv_heads": 1}
    if arch == "mixtral":
        recipe.update(arch="mixtral", experts=4, top_k=2)
    elif arch == "llava":
        recipe.update(arch="llava", image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    return recipe


def is_complete(path: Path, arch: str = "llama", seed: int = SEED) -> bool:
    stamp = path / STAMP
    if not stamp.is_file():
        return False
    try:
        return bool(json.loads(stamp.read_text()) == _recipe(arch, seed))
    except ValueError:
        return False


def _train_tokenizer(out: Path, extra_special: tuple[str, ...] = (), chat_template: str = CHAT_TEMPLATE) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = [*SPECIAL_TOKENS, *extra_special]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=special, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        additional_special_tokens=special[4:],
    )
    fast.chat_template = chat_template
    fast.save_pretrained(out)
    return fast


def make(path: Path, arch: str = "llama", seed: int = SEED) -> Path:
    """Create the model in ``path`` unless a complete one is there already."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}")
    if is_complete(path, arch, seed):
        return path
    import torch
    from transformers import GenerationConfig

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-model-", dir=path.parent))
    try:
        torch.manual_seed(seed)
        config = (_save_llava(tmp) if arch == "llava" else _save_text_model(tmp, moe=arch == "mixtral"))
        GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                         pad_token_id=config.pad_token_id).save_pretrained(tmp)
        (tmp / STAMP).write_text(json.dumps(_recipe(arch, seed)))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _text_config(tokenizer: Any, cls: Any, **kw: Any) -> Any:
    return cls(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, head_dim=32, max_position_embeddings=2048, rms_norm_eps=1e-5,
               rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, initializer_range=0.2,
               torch_dtype="float32", **kw)


def _save_text_model(out: Path, moe: bool) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    tokenizer = _train_tokenizer(out)
    if moe:
        config = _text_config(tokenizer, MixtralConfig, intermediate_size=64, num_local_experts=4,
                              num_experts_per_tok=2)
        model = MixtralForCausalLM(config).to(torch.float32)
    else:
        config = _text_config(tokenizer, LlamaConfig, intermediate_size=128)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return config


def _save_llava(out: Path) -> Any:
    """A tiny LLaVA, saved in the layout vLLM loads (its vision tower as ``vision_tower.vision_model``)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer: Any = _train_tokenizer(out, (IMAGE_TOKEN,), LLAVA_CHAT_TEMPLATE)
    text = _text_config(tokenizer, LlamaConfig, intermediate_size=128)
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=64)
    tokens_per_image = (IMAGE_SIZE // PATCH_SIZE) ** 2
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), projector_hidden_act="gelu",
                         vision_feature_select_strategy="default", vision_feature_layer=-2,
                         image_seq_length=tokens_per_image)
    LlavaForConditionalGeneration(config).to(torch.float32).save_pretrained(out, safe_serialization=True)
    weights = out / "model.safetensors"
    state = {("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.") else k): v
             for k, v in load_file(str(weights)).items()}
    save_file(state, str(weights), metadata={"format": "pt"})
    square = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    images = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size=square)
    LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH_SIZE,
                   vision_feature_select_strategy="default", chat_template=LLAVA_CHAT_TEMPLATE,
                   num_additional_image_tokens=1).save_pretrained(out)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--moe", action="store_true", help="a tiny Mixtral (routed experts) instead of Llama")
    kind.add_argument("--llava", action="store_true", help="a tiny LLaVA (images) instead of Llama")
    parser.add_argument("--seed", type=int, default=SEED, help="the weights' random seed")
    args = parser.parse_args(argv)
    arch = "mixtral" if args.moe else "llava" if args.llava else "llama"
    print(make(args.directory, arch=arch, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
