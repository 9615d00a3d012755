"""The committed gRPC stubs are what the .proto files generate today."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_the_protos(tmp_path):
    protos = sorted((ROOT / "protos").glob("*.proto"))
    assert {p.stem for p in protos} == {"common", "planner", "executor", "cachestore"}
    (tmp_path / "protos").mkdir()
    for p in protos:
        (tmp_path / "protos" / p.name).write_bytes(p.read_bytes())
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.",
                    "--grpc_python_out=.", *[f"protos/{p.name}" for p in protos]], cwd=tmp_path, check=True)
    generated = sorted(f.name for f in (tmp_path / "protos").iterdir() if f.suffix in (".py", ".pyi"))
    assert len(generated) == 3 * len(protos)
    stale = [name for name in generated
             if not (ROOT / "protos" / name).exists()
             or (ROOT / "protos" / name).read_bytes() != (tmp_path / "protos" / name).read_bytes()]
    assert not stale, f"stale gRPC stubs (run `make protos`): {stale}"


def test_package_is_kvplan_v1():
    from protos import common_pb2, executor_pb2, planner_pb2
    assert common_pb2.CompressionPlan.DESCRIPTOR.full_name == "kvplan.v1.CompressionPlan"
    assert executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name == "kvplan.v1.Executor"
    assert planner_pb2.DESCRIPTOR.services_by_name["Planner"].full_name == "kvplan.v1.Planner"
