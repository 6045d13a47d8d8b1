"""Builds keel-client with the public protos' Python stubs (keel/gateway/v1, keel/common/v1),
generated from the repository's protos/ by grpc_tools at build time, so the wheel always matches them."""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PROTOS = Path(__file__).resolve().parents[2] / "protos"
PUBLIC = ("keel/common/v1/common.proto", "keel/gateway/v1/gateway.proto")


class BuildWithStubs(build_py):
    def run(self) -> None:
        super().run()
        from grpc_tools import protoc

        out = Path(self.build_lib)
        args = ["protoc", f"-I{PROTOS}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}",
                *(str(PROTOS / p) for p in PUBLIC)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PUBLIC} under {PROTOS}")


setup(cmdclass={"build_py": BuildWithStubs})
