"""Drive a ustor RPC test server with SPDK's own Python client.

Usage: spdk_client.py SOCKET_PATH. Prints one JSON object with what each
call returned (or the error text it raised); the Rust test checks it.
"""
import io
import json
import sys

from spdk.rpc.client import JSONRPCClient, JSONRPCException
from spdk.rpc import config as spdk_config


def main(sock):
    out = {}
    client = JSONRPCClient(sock, timeout=10.0)
    out["echo"] = client.call("echo", {"a": 1, "nested": {"b": [1, 2]}})
    # Empty params are omitted on the wire by SPDK's client.
    out["echo_empty"] = client.call("echo")
    out["methods"] = client.call("rpc_get_methods")
    # Attribute-style calls, as rpc.py's helpers make them.
    out["create"] = client.create(name="m0", block_size=512, num_blocks=8)
    out["slow"] = client.call("slow", {"ms": 50, "value": "later"})
    for name, method, params in [
        ("fail", "fail", {"errno": 17}),
        ("bad_param", "create", {"name": "x", "block_size": 512, "bogus": 1}),
        ("not_found", "no_such_method", None),
    ]:
        try:
            client.call(method, params)
            out[name] = None
        except JSONRPCException as e:
            out[name] = e.message

    # save_config / load_config exactly as rpc.py runs them.
    buf = io.StringIO()
    spdk_config.save_config(client, buf, indent=2)
    out["saved"] = json.loads(buf.getvalue())
    cfg = {"subsystems": [{"subsystem": "bdev", "config": [
        {"method": "record", "params": {"name": "from_config"}}]}]}
    spdk_config.load_config(client, io.StringIO(json.dumps(cfg)))

    # Batch mode: one JSON array out, one array back.
    batch = JSONRPCClient(sock, timeout=10.0, batch_mode=True)
    batch.call("echo", {"x": 1})
    batch.call("no_such_method")
    batch.send_batch()
    results, errors = JSONRPCClient.handle_batch_response(batch.recv())
    out["batch"] = {"results": results, "errors": errors}
    batch.close()
    client.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
