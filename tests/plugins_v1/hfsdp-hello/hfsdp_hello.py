"""hfsdp_hello: write a greeting into the run folder when training ends."""
from pydantic import BaseModel, ConfigDict

import hfsdp


class HelloConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a typo in the section is a config error
    greeting: str = "hello"


@hfsdp.hookimpl
def hfsdp_config_section():
    return "hello", HelloConfig


@hfsdp.hookimpl
def hfsdp_on_train_end(run, metrics):
    if run.is_main_process:
        greeting = run.config.section("hello").greeting
        text = f"{greeting} after {run.state.step} steps, eval loss {metrics.get('eval_loss')}\n"
        (run.output_dir / "hello.txt").write_text(text)
