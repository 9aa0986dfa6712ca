"""Client commands: `pagedserve generate`, `pagedserve chat`, `pagedserve status`.

Each connects in plain gRPC, or over TLS with `--tls-ca` (and mutual TLS with `--tls-cert`/`--tls-key`),
and sends `--api-key` (or $PAGEDSERVE_API_KEY, which keeps it out of the process list) as a bearer token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import grpc
from google.protobuf.json_format import MessageToDict

from ...protos import inference_pb2 as pb
from ...protos import inference_pb2_grpc as pb_grpc
from ..common.tls import TlsConfigError, channel_credentials


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--tls", action="store_true", help="TLS, verifying the server with the system's roots")
    parser.add_argument("--tls-ca", metavar="PEM", help="TLS, verifying the server with this CA (implies --tls)")
    parser.add_argument("--tls-cert", metavar="PEM", help="mutual TLS: this client certificate (implies --tls)")
    parser.add_argument("--tls-key", metavar="PEM", help="mutual TLS: its private key")
    parser.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY", ""),
                        help="sent as `authorization: Bearer KEY` (default: $PAGEDSERVE_API_KEY)")


def connect(args: argparse.Namespace) -> grpc.Channel:
    if not (args.tls or args.tls_ca or args.tls_cert or args.tls_key):
        return grpc.insecure_channel(args.address)
    try:
        return grpc.secure_channel(args.address, channel_credentials(args.tls_ca, args.tls_cert, args.tls_key))
    except TlsConfigError as exc:
        raise SystemExit(f"error: {exc}") from None


def call_metadata(args: argparse.Namespace) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {args.api_key}")] if args.api_key else []


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    add_connection_arguments(parser)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--n", type=int, default=1, help="parallel samples")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--timeout", type=float, default=600.0, help="the request's deadline in seconds")
    parser.add_argument("prompt", help="the prompt text")


def _params(args: argparse.Namespace) -> pb.GenerationParameters:
    params = pb.GenerationParameters(max_tokens=args.max_tokens, temperature=args.temperature, n=args.n, stop=args.stop)
    for name in ("top_p", "top_k", "seed"):
        if getattr(args, name) is not None:
            setattr(params, name, getattr(args, name))
    return params


def _fail(exc: grpc.RpcError) -> None:
    print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
    raise SystemExit(1)


def generate_main(args: argparse.Namespace) -> None:
    request = pb.GenerateRequest(text=args.prompt, params=_params(args))
    texts: dict[int, list[str]] = {}
    with connect(args) as channel:
        try:
            for chunk in pb_grpc.InferenceStub(channel).Generate(request, timeout=args.timeout,
                                                                   metadata=call_metadata(args)):
                if args.n == 1:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                else:
                    texts.setdefault(chunk.index, []).append(chunk.text)
        except grpc.RpcError as exc:
            _fail(exc)
    if args.n == 1:
        print()
    for index in sorted(texts):
        print(f"--- sample {index}\n{''.join(texts[index])}")


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    add_connection_arguments(parser)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--system", help="a system message")


def chat_main(args: argparse.Namespace) -> None:
    messages = [pb.ChatMessage(role="system", content=args.system)] if args.system else []
    interactive = sys.stdin.isatty()
    with connect(args) as channel:
        stub = pb_grpc.InferenceStub(channel)
        while True:
            try:
                line = input("you> " if interactive else "")
            except EOFError:
                break
            if line.strip() in ("/exit", "/quit"):
                break
            if not line.strip():
                continue
            messages.append(pb.ChatMessage(role="user", content=line))
            params = pb.GenerationParameters(max_tokens=args.max_tokens, temperature=args.temperature)
            reply = []
            print("assistant> " if interactive else "", end="", flush=True)
            try:
                for chunk in stub.Generate(pb.GenerateRequest(chat=pb.Chat(messages=messages), params=params),
                                           metadata=call_metadata(args)):
                    reply.append(chunk.text)
                    print(chunk.text, end="", flush=True)
            except grpc.RpcError as exc:
                _fail(exc)
            print(flush=True)
            messages.append(pb.ChatMessage(role="assistant", content="".join(reply)))


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    add_connection_arguments(parser)
    parser.add_argument("--json", action="store_true", help="one JSON object")


def status_main(args: argparse.Namespace) -> None:
    with connect(args) as channel:
        try:
            status = pb_grpc.InferenceStub(channel).Status(pb.StatusRequest(), timeout=10, metadata=call_metadata(args))
        except grpc.RpcError as exc:
            _fail(exc)
    fields = MessageToDict(status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    if args.json:
        print(json.dumps(fields))
    else:
        for key, value in fields.items():
            print(f"{key:>28}: {value}")
