"""The committed code of the gRPC API is what its proto generates (`just proto`)."""

from __future__ import annotations

from appliance.grpc import codegen


def test_the_generated_code_is_current_with_the_proto() -> None:
    folder = codegen.ROOT / codegen.PROTO.parent
    committed = {name: (folder / name).read_bytes() for name in codegen.OUTPUTS}
    generated = codegen.current()
    stale = sorted(name for name in codegen.OUTPUTS if generated[name] != committed[name])
    assert not stale, f"{', '.join(stale)} differ from the proto: run `just proto`"
