#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora under tests/fuzz/corpus from the test fixtures and
from the formats' own writers (safetensors, tokenizers, protobuf, cryptography).

Run from anywhere: python3 tests/fuzz/make_seeds.py. Its outputs are committed; rerun it when
fixtures change. Seeds are small on purpose: the fuzzer mutates the structure, not a 150 kB
vocabulary (tokenizer.json seeds keep the pipeline of each fixture with its vocabulary cut).
"""
from __future__ import annotations

import datetime
import json
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save as save_safetensors
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
CORPUS = ROOT / "tests" / "fuzz" / "corpus"
sys.path.insert(0, str(ROOT / "scripts"))
import tgis_proto  # noqa: E402


def fresh(name: str) -> Path:
    d = CORPUS / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    return d


def safetensors_seeds():
    d = fresh("safetensors")
    rng = np.random.default_rng(0)
    (d / "f32.safetensors").write_bytes(save_safetensors(
        {"w": rng.standard_normal((4, 3), dtype=np.float32), "b": np.zeros(3, np.float32)},
        metadata={"format": "pt"}))
    (d / "mixed.safetensors").write_bytes(save_safetensors({
        "h": rng.standard_normal((2, 2)).astype(np.float16),
        "i": np.arange(5, dtype=np.int64),
        "j": np.arange(3, dtype=np.int32),
        "k": np.arange(4, dtype=np.int8),
        "scalar": np.array(1.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }))
    # bf16, which numpy cannot write: the header by hand, as the format specifies it.
    data = struct.pack("<4H", 0x3F80, 0x4000, 0xC040, 0x0000)
    header = json.dumps({"x": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}})
    header = header.encode() + b" " * (-len(header) % 8)
    (d / "bf16.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)


def torch_seeds():
    d = fresh("torch_file")
    for f in sorted((FIXTURES / "torch_files").glob("*")):
        if f.suffix in (".pt", ".bin") and f.stat().st_size <= 16384:
            shutil.copy(f, d / f.name)


def config_seeds():
    d = fresh("model_config")
    for f in sorted((FIXTURES / "models").glob("*/config.json")):
        shutil.copy(f, d / f"{f.parent.name}.json")


def shrink_tokenizer(doc: dict, keep: int = 400) -> dict:
    """The same pipeline with the model's vocabulary cut to its first `keep` ids."""
    model = doc["model"]
    kind = model.get("type")
    if kind in ("BPE", "WordPiece", "WordLevel"):
        vocab = {t: i for t, i in model["vocab"].items() if i < keep}
        model["vocab"] = vocab
        if kind == "BPE":
            merges = []
            for m in model.get("merges", []):
                a, b = m.split(" ", 1) if isinstance(m, str) else m
                if a in vocab and b in vocab and a + b in vocab:
                    merges.append(m)
            model["merges"] = merges
        if "unk_token" in model and model["unk_token"] not in vocab and model["unk_token"]:
            vocab[model["unk_token"]] = len(vocab)
    elif kind == "Unigram":
        model["vocab"] = model["vocab"][:keep]
        if model.get("unk_id") is not None and model["unk_id"] >= keep:
            model["unk_id"] = 0
    # Added tokens get ids after the cut vocabulary.
    next_id = max(keep, 1 + max(model["vocab"].values()) if isinstance(model["vocab"], dict)
                  else len(model["vocab"]))
    remap = {}
    for t in doc.get("added_tokens", []):
        if t["id"] >= keep:
            remap[t["id"]] = next_id
            t["id"] = next_id
            next_id += 1
    # Post-processors name special tokens by id: follow the renumbering.
    def fix(node):
        if isinstance(node, dict):
            if "ids" in node and isinstance(node["ids"], list):
                node["ids"] = [remap.get(i, i) for i in node["ids"]]
            for k, v in node.items():
                if k in ("sep", "cls") and isinstance(v, list) and len(v) == 2:
                    node[k] = [v[0], remap.get(v[1], v[1])]
                else:
                    fix(v)
        elif isinstance(node, list):
            for v in node:
                fix(v)
    fix(doc.get("post_processor"))
    return doc


def tokenizer_seeds():
    d = fresh("tokenizer_json")
    for f in sorted((FIXTURES / "tokenizers").glob("*/tokenizer.json")):
        if f.parent.name == "t5_hub":
            continue  # the same 320 kB precompiled charsmap as t5's: one is enough
        doc = shrink_tokenizer(json.loads(f.read_text()))
        text = json.dumps(doc, ensure_ascii=False)
        Tokenizer.from_str(text).encode("Hello world")  # HF must load what we seed
        (d / f"{f.parent.name}.json").write_text(text)
    c = fresh("tokenizer_config")
    for f in sorted((FIXTURES / "tokenizers").glob("*/tokenizer_config.json")):
        data = f.read_bytes()
        (c / f"{f.parent.name}_json").write_bytes(b"\x00" + data)
        (c / f"{f.parent.name}_spm").write_bytes(b"\x01" + data)


def request_seeds():
    d = fresh("request")
    pb = tgis_proto.load("generation")[0]
    params = pb.Parameters(
        method=pb.SAMPLE,
        sampling=pb.SamplingParameters(temperature=0.7, top_k=5, top_p=0.9, typical_p=0.5,
                                       seed=42),
        stopping=pb.StoppingCriteria(max_new_tokens=10, min_new_tokens=1,
                                     stop_sequences=["world", "\n"], include_stop_sequence=True,
                                     time_limit_millis=1000),
        response=pb.ResponseOptions(input_text=True, generated_tokens=True, input_tokens=True,
                                    token_logprobs=True, token_ranks=True, top_n_tokens=2),
        decoding=pb.DecodingParameters(repetition_penalty=1.2,
                                       length_penalty=pb.DecodingParameters.LengthPenalty(
                                           start_index=2, decay_factor=1.5)),
        truncate_input_tokens=8)
    texts = ["Hello world, how are you?", "h\u00e9llo \u65e5\u672c \U0001F917", "", "a " * 80]
    for tok in range(6):
        batched = pb.BatchedGenerationRequest(
            model_id="m", requests=[pb.GenerationRequest(text=t) for t in texts], params=params)
        (d / f"generate_{tok}").write_bytes(bytes([0 + 3 * tok]) + batched.SerializeToString())
        single = pb.SingleGenerationRequest(model_id="m", prefix_id="p",
                                            request=pb.GenerationRequest(text=texts[tok % 4]))
        (d / f"stream_{tok}").write_bytes(bytes([1 + 3 * tok]) + single.SerializeToString())
        tokenize = pb.BatchedTokenizeRequest(
            model_id="m", requests=[pb.TokenizeRequest(text=t) for t in texts],
            return_tokens=True, return_offsets=True, truncate_input_tokens=3)
        (d / f"tokenize_{tok}").write_bytes(bytes([2 + 3 * tok]) + tokenize.SerializeToString())
    (d / "greedy_defaults").write_bytes(
        b"\x00" + pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="x")])
        .SerializeToString())
    guided_request_seeds(pb, d)


def guided_request_seeds(pb, d: Path):
    """Guided decoding's DecodingParameters (regex, choice, json_schema, format JSON)."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 4},
                                               "b": {"enum": [1, "x", None]}},
              "required": ["a"]}
    decodings = [pb.DecodingParameters(regex=r"[0-9]{3}-(a|b)+\.?"),
                 pb.DecodingParameters(choice=pb.DecodingParameters.StringChoices(
                     choices=["yes", "no", "\u65e5\u672c"])),
                 pb.DecodingParameters(json_schema=json.dumps(schema)),
                 pb.DecodingParameters(format=pb.DecodingParameters.JSON),
                 pb.DecodingParameters(grammar='root ::= "yes" | [0-9]{1,3}\nws ::= [ ]*')]
    for i, dec in enumerate(decodings):
        req = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="x")],
                                          params=pb.Parameters(decoding=dec))
        (d / f"guided_{i}").write_bytes(b"\x00" + req.SerializeToString())


def pem_seeds():
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import NameOID

    d = fresh("pem")
    start = datetime.datetime(2025, 1, 1, tzinfo=datetime.timezone.utc)
    end = start + datetime.timedelta(days=365 * 100)

    def cert(subject_key, subject, issuer_key, issuer, ca):
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
             .public_key(subject_key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(start).not_valid_after(end)
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]),
                                critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    name = lambda cn: x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])  # noqa: E731
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = cert(ca_key, name("fuzz CA"), ca_key, name("fuzz CA"), True)
    server_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    server = cert(server_key, name("localhost"), ca_key, name("fuzz CA"), False)
    pem = serialization.Encoding.PEM
    key_pem = server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption())
    ec_key_pem = ca_key.private_bytes(pem, serialization.PrivateFormat.TraditionalOpenSSL,
                                      serialization.NoEncryption())
    chain = server.public_bytes(pem) + ca.public_bytes(pem)
    (d / "valid_cert").write_bytes(server.public_bytes(pem))
    (d / "valid_key").write_bytes(key_pem)
    (d / "valid_ca").write_bytes(ca.public_bytes(pem))
    (d / "cert_chain").write_bytes(b"\x00" + chain)
    (d / "key_pkcs8").write_bytes(b"\x01" + key_pem)
    (d / "key_ec").write_bytes(b"\x01" + ec_key_pem)
    (d / "ca").write_bytes(b"\x02" + ca.public_bytes(pem))


if __name__ == "__main__":
    safetensors_seeds()
    torch_seeds()
    config_seeds()
    tokenizer_seeds()
    request_seeds()
    pem_seeds()
    for d in sorted(CORPUS.iterdir()):
        files = list(d.iterdir())
        print(f"{d.name}: {len(files)} seeds, {sum(f.stat().st_size for f in files)} bytes")
