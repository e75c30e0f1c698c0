"""The README's custom-kind example runs as written: imported as a kinds module from a
directory on PYTHONPATH through ORCH_KIND_MODULES (as the README says), then run for a step."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

RUN_ONE_STEP = """
import asyncio, logging, uuid
from orch_contracts.kinds import load_kinds
from orch_contracts.settings import CommonSettings
from observer_service import ObserverContext

logging.basicConfig(level=logging.INFO)
spec = load_kinds(CommonSettings().kind_module_list)["price_watch"]
params = spec.params_model.model_validate({"symbol": "BTC", "interval": 0.01})
saved = []

async def save(state):
    saved.append(state)

async def main():
    ctx = ObserverContext(
        observer_id=uuid.uuid4(), name="readme", kind="price_watch", epoch=1,
        service_id=uuid.uuid4(), params=params, last_checkpoint=None, save=save,
        alive=lambda: True,
    )
    task = asyncio.create_task(spec.run(ctx))
    while not saved:
        assert not task.done(), task
        await asyncio.sleep(0.01)
    task.cancel()

asyncio.run(asyncio.wait_for(main(), 10))
print("checkpointed", saved[0])
"""


def readme_kind_example() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Writing an observer kind", 1)[1]
    match = re.search(r"```python\n(# mykinds\.py\n.*?)```", section, re.S)
    assert match, "the README's kind example (a python block starting with # mykinds.py)"
    return match.group(1)


def test_the_readme_kind_example_loads_and_runs(tmp_path: Path) -> None:
    (tmp_path / "mykinds.py").write_text(readme_kind_example())
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
    env.update(PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", ORCH_KIND_MODULES="mykinds")
    done = subprocess.run(
        [sys.executable, "-c", RUN_ONE_STEP],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "checkpointed {'price':" in done.stdout
    assert "BTC is now" in done.stderr, "ctx.logger logged the change"


def test_the_readme_says_where_a_kinds_module_is_imported_from() -> None:
    section = (ROOT / "README.md").read_text().split("## Writing an observer kind", 1)[1]
    section = section.split("\n## ", 1)[0]
    assert "ORCH_KIND_MODULES" in section
    assert "PYTHONPATH" in section
    assert "ctx.logger" in readme_kind_example()


def test_the_readme_kind_refuses_an_interval_that_is_not_positive(tmp_path: Path) -> None:
    """``-p interval=-5`` is refused at create (the manager checks params against the model, or
    the schema the services advertise), not run as a hot loop."""
    (tmp_path / "mykinds.py").write_text(readme_kind_example())
    check = (
        "from orch_contracts.errors import InvalidParams\n"
        "from orch_contracts.kinds import KindSpec, load_kinds\n"
        "spec = load_kinds(['mykinds'])['price_watch']\n"
        "advertised = KindSpec.from_advert('price_watch', spec.advert())\n"
        "for s in (spec, advertised):\n"
        "    for interval in (-5, 0):\n"
        "        try:\n"
        "            s.validate_params({'symbol': 'BTC', 'interval': interval})\n"
        "        except InvalidParams as exc:\n"
        "            print(exc)\n"
        "        else:\n"
        "            print('accepted', interval)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
    env.update(PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    done = subprocess.run(
        [sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "accepted" not in done.stdout
    assert done.stdout.count("interval") == 4, done.stdout
