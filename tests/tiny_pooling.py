"""Tiny random pooling models (sentence-transformers embedders, cross-encoders) saved as directories,
the oracles of the embedding and rerank tests."""

from __future__ import annotations

import random
import tempfile

import torch
import transformers
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

WORDS = """the of and to in is it you that he was for on are with as his they be at one have this from or had
by hot word but what some we can out other were all there when up use your how said an each she which do
their time if will way about many then them write would like so these her long make thing see him two has
look more day could go come did number sound no most people my over know water than call first who may down
side been now find any new work part take get place made live where after back little only round man year
came show every good me give our under name very through just form sentence great think say help low line
differ turn cause much mean before move right boy old too same tell does set three want air well also play
small end put home read hand port large spell add even land here must big high such follow act why ask men
change went light kind off need house picture try us again animal point mother world near build self earth
father head stand own page should country found answer school grow study still learn plant cover food sun
four between state keep eye never last let thought city tree cross farm hard start might story saw far sea
draw left late run while press close night real life few north open cat dog walk talk hello""".split()
PIECES = ["##s", "##es", "##ed", "##ing", "##ly", "##er", "##est", "##ness", "##ful", "##less", "##able", "##y"]
BASE = WORDS + list("abcdefghijklmnopqrstuvwxyz0123456789") + list(".,?!'-:;")
SUFFIXES = ["s", "ed", "ing", "ly", "er"]

ARCHS = {  # arch -> (config class, base model class, sequence-classification class, tokenizer kind)
    "bert": ("BertConfig", "BertModel", "BertForSequenceClassification", "bert"),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel", "XLMRobertaForSequenceClassification", "roberta"),
    "qwen3": ("Qwen3Config", "Qwen3Model", "Qwen3ForSequenceClassification", "qwen"),
    "qwen2": ("Qwen2Config", "Qwen2Model", "Qwen2ForSequenceClassification", "qwen"),
}


def word_tokenizer(kind: str) -> transformers.PreTrainedTokenizerFast:
    """A tokenizer over the words above.

    "bert": WordPiece (about 320 entries, "##" pieces, [UNK]), [CLS] A [SEP] B [SEP], type ids 0/1.
    "roberta": word level (about 300, <unk>), XLM-R specials (<pad> is 1), <s> A </s></s> B </s>.
    "qwen": byte-level BPE (the 256 bytes, merges spelling " word", about 870 entries): no BOS,
    <|endoftext|> after each sequence and as pad; unknown words split into bytes, as in Qwen. It is a
    Qwen2Tokenizer because transformers rebuilds one (NFC, byte level, BPE without unk) from any
    qwen2-type directory whatever tokenizer_config.json names."""
    if kind == "bert":
        vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + BASE + PIECES
        return transformers.BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}, model_max_length=512)
    if kind == "qwen":
        ids = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
        merges = []
        for word in WORDS:  # "Ġ" is the space byte; a word's prefixes, merged one letter at a time
            for n in range(1, len(word) + 1):
                if "Ġ" + word[:n] not in ids:
                    merges.append(("Ġ" + word[:n - 1], word[n - 1]))
                    ids["Ġ" + word[:n]] = len(ids)
        for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
            ids[special] = len(ids)
        tok = transformers.Qwen2Tokenizer(vocab=ids, merges=merges, unk_token=None, model_max_length=512,
                                          extra_special_tokens=["<|im_start|>", "<|im_end|>"])
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="$A <|endoftext|>", pair="$A <|endoftext|> $B <|endoftext|>",
            special_tokens=[("<|endoftext|>", ids["<|endoftext|>"])])
        return tok
    if kind != "roberta":
        raise ValueError(kind)
    vocab = ["<s>", "<pad>", "</s>", "<unk>"] + BASE + ["<mask>"]
    ids = {w: i for i, w in enumerate(vocab)}
    tok = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
                                                       special_tokens=[("<s>", 0), ("</s>", 2)])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", cls_token="<s>", sep_token="</s>",
        pad_token="<pad>", unk_token="<unk>", mask_token="<mask>", model_max_length=512,
        model_input_names=["input_ids", "attention_mask"])


def _build(arch: str, head: bool, num_labels: int = 1, **overrides):
    """(random transformers model, its tokenizer): tiny sizes unless `overrides` says otherwise."""
    cfg_cls, base_cls, head_cls, kind = ARCHS[arch]
    tok = word_tokenizer(kind)
    cfg = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
               vocab_size=len(tok), pad_token_id=tok.pad_token_id, max_position_embeddings=128)
    if kind == "qwen":
        cfg.update(num_key_value_heads=2, eos_token_id=tok.eos_token_id, bos_token_id=None)
    else:
        cfg.update(hidden_act="gelu", type_vocab_size=2 if kind == "bert" else 1)
    if arch == "xlm-roberta":  # positions start at pad + 1 = 2
        cfg.update(max_position_embeddings=130, bos_token_id=0, eos_token_id=2)
    cfg.update(overrides)
    if arch == "qwen3":
        cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    torch.manual_seed(0)
    model = getattr(transformers, head_cls if head else base_cls)(
        getattr(transformers, cfg_cls)(num_labels=num_labels, **cfg))
    for name, p in model.named_parameters():  # larger weights than the init, so errors are not hidden by tiny outputs
        p.data.normal_(0, 0.08)
        if "norm" in name.lower() and name.endswith("weight"):  # LayerNorm / RMSNorm scales near 1
            p.data.add_(1.0)
    # sentence-transformers caps the tokenizer at max_position_embeddings; XLM-R has 2 fewer positions
    tok.model_max_length = cfg["max_position_embeddings"] - (2 if arch == "xlm-roberta" else 0)
    return model.eval(), tok


# sentence-transformers imports scikit-learn, which loads its own OpenMP runtime beside torch's: a
# test process must not, or the native kernels' single-runtime check (and their use) breaks. Everything
# that imports it runs in a child process.
_CHILD = """
import json, sys, traceback
import numpy as np
sys.path.insert(0, {here!r})
import tiny_pooling
for line in sys.stdin:
    job = json.loads(line)
    try:
        result = getattr(tiny_pooling, job["fn"])(*job["args"], **job["kwargs"])
        if not isinstance(result, str):
            np.save(job["out"], np.asarray(result, np.float32))
            result = None
        reply = {{"result": result}}
    except Exception:
        reply = {{"error": traceback.format_exc()}}
    print(json.dumps(reply), flush=True)
"""
_worker = None  # one child per test process, kept for every call (importing sentence-transformers takes seconds)


def _child(fn: str, *args, **kwargs):
    import atexit
    import json
    import os
    import subprocess
    import sys

    import numpy as np

    global _worker
    if _worker is None or _worker.poll() is not None:
        here = os.path.dirname(os.path.abspath(__file__))
        _worker = subprocess.Popen([sys.executable, "-c", _CHILD.format(here=here)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        atexit.register(_worker.kill)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.npy")
        _worker.stdin.write(json.dumps({"fn": fn, "args": args, "kwargs": kwargs, "out": out}) + "\n")
        _worker.stdin.flush()
        line = _worker.stdout.readline()
        if not line:
            raise RuntimeError(f"{fn}: the sentence-transformers child process died")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{fn} failed in the child process:\n{reply['error']}")
        return np.load(out) if reply["result"] is None else reply["result"]


def save_embedding_model(path, arch: str, pooling: str = "mean", normalize: bool = True, **config_overrides) -> str:
    """A SentenceTransformer (Transformer, Pooling(`pooling`), Normalize if `normalize`) of a random
    `arch` base model ("bert", "xlm-roberta", "qwen3", "qwen2") saved to `path` (in a child process)."""
    return _child("_save_embedding_model", str(path), arch, pooling, normalize, **config_overrides)


def st_encode(path, texts: list[str], batch_size: int = 32, **init) -> "np.ndarray":
    """sentence-transformers' own `SentenceTransformer(path, **init).encode(texts)`, in a child process."""
    return _child("_st_encode", str(path), list(texts), batch_size, **init)


def st_predict(path, pairs: list[tuple[str, str]]) -> "np.ndarray":
    """sentence-transformers' own `CrossEncoder(path).predict(pairs)`, in a child process."""
    return _child("_st_predict", str(path), [list(p) for p in pairs])


def _st_encode(path: str, texts: list[str], batch_size: int, **init):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device="cpu", **init).encode(texts, batch_size=batch_size)


def _st_predict(path: str, pairs: list[list[str]]):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(path, device="cpu").predict([tuple(p) for p in pairs])


def _save_embedding_model(path: str, arch: str, pooling: str, normalize: bool, **config_overrides) -> str:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    model, tok = _build(arch, head=False, **config_overrides)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        first = Transformer(tmp)
        modules = [first, Pooling(first.get_embedding_dimension(), pooling_mode=pooling)]
        if normalize:
            modules.append(Normalize())
        SentenceTransformer(modules=modules, device="cpu").save(str(path))
    return str(path)


def save_cross_encoder(path, arch: str, num_labels: int = 1, **config_overrides) -> str:
    """A random `arch` ForSequenceClassification ("bert", "xlm-roberta", "qwen3") and its tokenizer,
    saved to `path` with save_pretrained (CrossEncoder(path) loads it; sigmoid on 1 label, else none)."""
    model, tok = _build(arch, head=True, num_labels=num_labels, **config_overrides)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return str(path)


def sentences(n: int, seed: int = 0, min_words: int = 3, max_words: int = 40) -> list[str]:
    """`n` random sentences of vocabulary words, lengths spread evenly over [min_words, max_words]
    in shuffled order; some words carry a suffix ("walked": walk ##ed in BERT, <unk> in XLM-R, " walk" e d
    in Qwen) and a few are made up ([UNK], <unk>, bytes)."""
    rng = random.Random(seed)
    lengths = [min_words + (max_words - min_words) * i // max(n - 1, 1) for i in range(n)]
    rng.shuffle(lengths)
    out = []
    for length in lengths:
        words = []
        for _ in range(length):
            r = rng.random()
            if r < 0.04:
                words.append("".join(rng.choice("bcdfghjklmnpqrstvwxz") for _ in range(rng.randint(4, 8))))
            elif r < 0.12:
                words.append(rng.choice(WORDS) + rng.choice(SUFFIXES))
            else:
                words.append(rng.choice(WORDS))
        text = " ".join(words)
        out.append(text[:1].upper() + text[1:] + rng.choice([".", ".", "?", "!", ""]))
    return out
