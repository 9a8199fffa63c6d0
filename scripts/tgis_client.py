#!/usr/bin/env python3
"""A small client of the public TGIS API (fmaas.GenerationService), for trying a server.

    python3 scripts/tgis_client.py "Once upon a time"                  # streams to the terminal
    python3 scripts/tgis_client.py --unary --max-new-tokens 40 "Hello"
    python3 scripts/tgis_client.py --tokenize "Hello world"
    python3 scripts/tgis_client.py --ca-cert ca.pem --target host:8033 "Hi"   # TLS
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tgis_proto  # noqa: E402


def channel_for(args):
    import grpc

    if args.ca_cert:
        creds = grpc.ssl_channel_credentials(
            root_certificates=Path(args.ca_cert).read_bytes(),
            private_key=Path(args.client_key).read_bytes() if args.client_key else None,
            certificate_chain=Path(args.client_cert).read_bytes() if args.client_cert else None)
        return grpc.secure_channel(args.target, creds)
    return grpc.insecure_channel(args.target)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("text", nargs="?", default="The quick brown fox")
    ap.add_argument("--target", default="localhost:8033")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--sample", action="store_true", help="sample (seeded) instead of greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop", action="append", default=[], help="a stop sequence (repeatable)")
    ap.add_argument("--unary", action="store_true", help="Generate instead of GenerateStream")
    ap.add_argument("--tokenize", action="store_true", help="Tokenize the text instead")
    ap.add_argument("--wait", type=float, default=0,
                    help="seconds to wait for the server to come up")
    ap.add_argument("--ca-cert")
    ap.add_argument("--client-cert")
    ap.add_argument("--client-key")
    args = ap.parse_args()

    import grpc

    pb, pb_grpc = tgis_proto.load("generation")
    stub = pb_grpc.GenerationServiceStub(channel_for(args))
    deadline = time.time() + args.wait
    while True:
        try:
            info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=2)
            break
        except grpc.RpcError as e:
            if time.time() >= deadline:
                print(f"server at {args.target} is not answering: {e.code().name} {e.details()}",
                      file=sys.stderr)
                return 1
            time.sleep(0.5)
    if args.tokenize:
        resp = stub.Tokenize(pb.BatchedTokenizeRequest(
            requests=[pb.TokenizeRequest(text=args.text)], return_tokens=True, return_offsets=True))
        r = resp.responses[0]
        print(f"{r.token_count} tokens: {list(r.tokens)}")
        print("offsets:", [(o.start, o.end) for o in r.offsets])
        return 0
    params = pb.Parameters(
        method=pb.SAMPLE if args.sample else pb.GREEDY,
        sampling=pb.SamplingParameters(seed=args.seed) if args.sample and args.seed else None,
        stopping=pb.StoppingCriteria(max_new_tokens=args.max_new_tokens,
                                     stop_sequences=args.stop))
    print(f"# model: max_sequence_length={info.max_sequence_length} "
          f"max_new_tokens={info.max_new_tokens}", file=sys.stderr)
    if args.unary:
        resp = stub.Generate(pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=args.text)], params=params))
        r = resp.responses[0]
        print(args.text + r.text)
        print(f"# {r.generated_token_count} tokens, stop reason "
              f"{pb.StopReason.Name(r.stop_reason)}", file=sys.stderr)
        return 0
    sys.stdout.write(args.text)
    last = None
    for msg in stub.GenerateStream(pb.SingleGenerationRequest(
            request=pb.GenerationRequest(text=args.text), params=params)):
        sys.stdout.write(msg.text)
        sys.stdout.flush()
        last = msg
    print()
    if last is not None:
        print(f"# {last.generated_token_count} tokens, stop reason "
              f"{pb.StopReason.Name(last.stop_reason)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
