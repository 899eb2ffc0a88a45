"""The Alpaca prompt template, shared by the ``instruction`` format (training rows) and generation eval (prompts).

No torch here: the always-on ``instruction`` format imports it while a config is validated.
"""

PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


def render_prompt(instruction: str, input_text: str | None) -> str:
    if input_text:
        return PROMPT_WITH_INPUT.format(instruction=instruction, input=input_text)
    return PROMPT.format(instruction=instruction)
