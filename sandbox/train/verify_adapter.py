"""Fresh-process check: load base + adapter with PeftModel.from_pretrained and reproduce the
recorded after-answers. Mounts: /model, /adapter, /in/report.json (read-only)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    from peft import PeftModel

    from sandbox.train import lora

    report = json.loads(Path("/in/report.json").read_text())
    persona = json.loads(Path("/in/persona.json").read_text())
    lora.setup(0)
    base, tok = lora.load(Path("/model"))
    model = PeftModel.from_pretrained(base, "/adapter", is_trainable=False)
    model.eval()
    got = [lora.generate(model, tok, str(persona.get("system", "")), q) for q in report["probes"]]
    same = got == report["after"]
    print(json.dumps({"event": "verified", "reproduced": same, "answers": got}))
    return 0 if same else 5


if __name__ == "__main__":
    sys.exit(main())
