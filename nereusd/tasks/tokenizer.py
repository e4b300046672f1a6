"""A model directory's tokenizer: ``transformers.AutoTokenizer``, its chat template and stop tokens.

:class:`HFTokenizer` gives the driver what the counting task's character tokenizer gives it
(``pad_id``, ``eos_id``, ``stop_ids``, ``vocab_size``, ``encode``, ``decode``) for a Hugging Face
tokenizer, plus :meth:`HFTokenizer.render`: a prompt rendered with the model's chat template
(``apply_chat_template`` with the generation prompt), with an optional system prompt. A response
ends at the tokenizer's EOS or any ``eos_token_id`` of the directory's ``generation_config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

from nereusd.errors import ConfigError

Messages = list[dict[str, str]]


class HFTokenizer:
    """The tokenizer of the Hugging Face model directory ``model_dir`` (module docstring).

    Raises:
        ConfigError: the directory has no loadable tokenizer, or it defines no EOS token.
    """

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self.model_dir = Path(model_dir)
        try:
            self._tok = AutoTokenizer.from_pretrained(str(self.model_dir))
        except (OSError, ValueError, TypeError) as err:
            raise ConfigError(f"{self.model_dir}: no loadable tokenizer ({type(err).__name__}: {err})") from None
        eos = self._tok.eos_token_id
        if eos is None:
            raise ConfigError(f"{self.model_dir}: the tokenizer defines no EOS token (eos_token)")
        stops = {int(eos)}
        gen_path = self.model_dir / "generation_config.json"
        if gen_path.is_file():
            try:
                gen = json.loads(gen_path.read_text())
            except json.JSONDecodeError as err:
                raise ConfigError(f"{gen_path}: not valid JSON: {err}") from None
            extra = gen.get("eos_token_id")
            stops |= {int(x) for x in (extra if isinstance(extra, list) else [extra]) if x is not None}
        self.eos_id = int(eos)
        self.stop_ids: tuple[int, ...] = tuple(sorted(stops))
        pad = self._tok.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self.vocab_size = len(self._tok)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` without special tokens (what a verifier reads)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def render(self, prompt: str | Messages, *, system_prompt: str | None = None,
               chat_template: bool = True) -> list[int]:
        """Token ids of ``prompt`` ready for generation.

        With ``chat_template`` the messages (a text prompt is one user message; ``system_prompt``
        is prepended unless the prompt has a system message) are rendered by the tokenizer's
        chat template with the generation prompt; without it the message contents are joined
        by blank lines and encoded as they are.

        Raises:
            ConfigError: ``chat_template`` asked for but the tokenizer has none.
        """
        messages: Messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system_prompt and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": system_prompt}, *messages]
        if not chat_template:
            return self.encode("\n\n".join(m["content"] for m in messages))
        if not self.has_chat_template:
            raise ConfigError(f"{self.model_dir}: the tokenizer has no chat template; set task.options.chat_template: "
                              "false to use the prompt text as it is")
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.encode(text)

    def token_lengths(self, texts: Sequence[str]) -> list[int]:
        return [len(self.encode(t)) for t in texts]


CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A ChatML chat template (``<|im_start|>role\\n…<|im_end|>``, the layout of Qwen2.5's)."""
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                           r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
"""Qwen2's pre-tokenizer split (its ``tokenizer.json``; ``transformers``' ``Qwen2Tokenizer``):
words, single digits, punctuation runs, newlines, spaces."""


def train_bpe_tokenizer(out: str | Path, texts: Iterable[str], vocab_size: int, *,
                        chat_template: str | None = CHATML_TEMPLATE) -> Path:
    """Train a byte-level BPE tokenizer on ``texts`` with ``tokenizers`` and save it as a Hugging
    Face tokenizer directory ``out`` (created): ``tokenizer.json``, ``tokenizer_config.json``
    (class ``Qwen2Tokenizer``), the chat template, and a ``generation_config.json`` whose
    ``eos_token_id`` is ``<|im_end|>``.

    The tokenizer is Qwen2's kind: NFC normalisation, :data:`QWEN2_PRETOKENIZE_REGEX` (single
    digits), byte-level BPE; special tokens :data:`CHATML_SPECIALS`, ``<|im_end|>`` EOS and
    ``<|endoftext|>`` pad. It is written as a ``Qwen2Tokenizer`` because ``transformers`` loads a
    directory whose ``config.json`` says ``qwen2`` with that class, which imposes this
    normalisation and split: trained any other way, the tokenizer would encode differently once the
    model's ``config.json`` sits beside it. For example and test models
    (``scripts/make_math_warmstart.py``, tiny test checkpoints); a real model brings its own.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(CHATML_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    eos = fast.convert_tokens_to_ids("<|im_end|>")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}) + "\n")
    return out
