"""Build hook: generate the fmaas protobuf/gRPC stubs into tgis/pb at install time."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent.resolve()


def generate_stubs() -> None:
    """Compile proto/generation.proto so generated imports read `from tgis.pb import ...`."""
    import shutil
    import tempfile

    from grpc_tools import protoc

    out_dir = ROOT / "tgis" / "pb"
    with tempfile.TemporaryDirectory() as tmp:
        # Staging the proto as tgis/pb/ under the include root makes protoc emit package-qualified imports.
        staged = Path(tmp) / "tgis" / "pb" / "generation.proto"
        staged.parent.mkdir(parents=True)
        shutil.copyfile(ROOT / "proto" / "generation.proto", staged)
        include = Path(protoc.__file__).parent / "_proto"
        args = [
            "protoc",
            f"-I{tmp}",
            f"-I{include}",
            f"--python_out={ROOT}",
            f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}",
            str(staged),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed to compile proto/generation.proto")
    shutil.copyfile(ROOT / "proto" / "generation.proto", out_dir / "generation.proto")


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        generate_stubs()
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
