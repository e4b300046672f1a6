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
from nereusd.hf_files import read_json_object

Messages = list[dict[str, str]]

TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",))
"""What a Hugging Face tokenizer is loaded from: a fast tokenizer's ``tokenizer.json``, a BPE
vocabulary and merges, or a SentencePiece model. Without any of them ``AutoTokenizer`` built a
``Qwen2Tokenizer`` of two tokens from ``tokenizer_config.json`` alone, and a job trained on
prompts of EOS only and reported success (an adversarial helper, 2026-12-06)."""
MIN_VOCAB = 16
"""Fewer tokens than this is a damaged tokenizer, not a model's (byte-level BPE has 256 bytes)."""


class HFTokenizer:
    """The tokenizer of the Hugging Face model directory ``model_dir`` (module docstring).

    Raises:
        ConfigError: the directory is missing or has no loadable tokenizer (none of
            :data:`TOKENIZER_FILES`, a damaged one, fewer than :data:`MIN_VOCAB` tokens), it
            defines no EOS token, or its ``generation_config.json`` is malformed; each names the
            path.
    """

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise ConfigError(f"{self.model_dir}: no such model directory (for its tokenizer)")
        if not any(all((self.model_dir / name).is_file() for name in files) for files in TOKENIZER_FILES):
            raise ConfigError(f"{self.model_dir}: no tokenizer files (tokenizer.json, or vocab.json and merges.txt, "
                              "or tokenizer.model); copy the model's tokenizer into the directory")
        try:
            self._tok = AutoTokenizer.from_pretrained(str(self.model_dir))
        except Exception as err:   # noqa: BLE001 - a damaged file raises whatever its parser does (KeyError, …)
            raise ConfigError(f"{self.model_dir}: no loadable tokenizer ({type(err).__name__}: {err})") from None
        self.vocab_size = len(self._tok)
        if self.vocab_size < MIN_VOCAB:
            raise ConfigError(f"{self.model_dir}: the tokenizer has {self.vocab_size} tokens; its files are damaged "
                              "or incomplete")
        eos = self._tok.eos_token_id
        if eos is None:
            raise ConfigError(f"{self.model_dir}: the tokenizer defines no EOS token (eos_token)")
        stops = {int(eos)} | set(self._generation_eos_ids())
        self.eos_id = int(eos)
        self.stop_ids: tuple[int, ...] = tuple(sorted(stops))
        pad = self._tok.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self.max_token_id = max([*self._tok.get_vocab().values(), *stops, self.pad_id])
        """The largest id the tokenizer can produce (a model's ``vocab_size`` must exceed it)."""

    def _generation_eos_ids(self) -> list[int]:
        """``eos_token_id`` of the directory's ``generation_config.json`` (an id or a list of
        ids; none without the file).

        Raises:
            ConfigError: the file is not UTF-8 JSON, not an object, or its ids are not integers.
        """
        path = self.model_dir / "generation_config.json"
        if not path.is_file():
            return []
        extra = read_json_object(path).get("eos_token_id")
        ids = extra if isinstance(extra, list) else [extra]
        if any(x is not None and (type(x) is not int or x < 0) for x in ids):
            raise ConfigError(f"{path}: eos_token_id: expected a token id or a list of them, got {extra!r}")
        return [x for x in ids if x is not None]

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
        try:
            text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as err:   # noqa: BLE001 - a template raises what its code does (1 // 0, …)
            raise ConfigError(f"{self.model_dir}: the chat template failed on a prompt ({type(err).__name__}: "
                              f"{str(err)[:200]}); fix the template, drop the system prompt, or set "
                              "task.options.chat_template: false") from None
        lost = [m["content"].strip() for m in messages if m["content"].strip() not in text]
        if lost:   # a template that writes whitespace or only its markers trained on empty prompts
            raise ConfigError(f"{self.model_dir}: the chat template's output {text[:80]!r} leaves out the "
                              f"message {lost[0][:60]!r}; fix the template or set task.options.chat_template: "
                              "false")
        return self.encode(text)

    def check_round_trip(self, text: str) -> None:
        """Refuse a tokenizer that cannot write ``text`` back (a vocabulary without merges, a
        truncated ``tokenizer.json``): decoding its encoding must give the same characters, whitespace
        aside (SentencePiece conversions differ in how they write spaces back) and up to Unicode
        compatibility forms.

        Raises:
            ConfigError: naming the directory and what came back.
        """
        import unicodedata

        def canonical(s: str) -> str:
            return "".join(unicodedata.normalize("NFKC", s).split())

        try:
            back = self.decode(self.encode(text))
        except (TypeError, ValueError):   # text it cannot take at all: the row's own check names it
            return
        if canonical(back) != canonical(text):
            raise ConfigError(f"{self.model_dir}: the tokenizer does not reproduce the dataset's text ({text[:40]!r} "
                              f"comes back as {back[:40]!r}); its tokenizer.json is damaged or incomplete")

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
