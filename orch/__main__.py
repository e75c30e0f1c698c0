from orch.cli import app

app(prog_name="orch")
