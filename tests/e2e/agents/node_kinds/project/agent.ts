// A log-triage agent in TypeScript, written four ways: one per SDK and API family.
//
// The case (/case/input.json) is {"question": "...", "variant": "..."}. Each variant
// answers with ONE call of the function tool read_log(service) (a log excerpt from
// /data/logs.json) and a final answer naming the failing component.
//
// Nothing here knows it runs under cyclebox: every client is built with no arguments
// and reads its endpoint and key from the environment (OPENAI_BASE_URL, OPENAI_API_KEY,
// ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY); the model name comes from $CYCLEBOX_MODEL.
import { readFileSync, writeFileSync } from "node:fs";
import { CALLS, canaryScan, READ, type Variant } from "./common.ts";

const VARIANTS: Record<string, () => Promise<{ run: Variant }>> = {
  openai_chat_stream: () => import("./variants/openai_chat_stream.ts"),
  openai_responses: () => import("./variants/openai_responses.ts"),
  anthropic_messages_stream: () => import("./variants/anthropic_messages_stream.ts"),
  ai_sdk_stream: () => import("./variants/ai_sdk_stream.ts"),
};

async function main(): Promise<number> {
  const kase = JSON.parse(readFileSync("/case/input.json", "utf8"));
  const variant = String(process.argv[2] ?? kase.variant ?? "");
  const load = VARIANTS[variant];
  if (!load) {
    console.error(`unknown variant ${JSON.stringify(variant)}`);
    return 2;
  }
  if (typeof kase.canary_scan === "string") canaryScan(kase.canary_scan);
  const system = readFileSync(new URL("./prompts/system.md", import.meta.url), "utf8");
  const { run } = await load();
  const reply = await run(kase.question, system, process.env.CYCLEBOX_MODEL ?? "");
  const answer = { answer: reply.trim(), refused: false, evidence: [...READ], variant,
                   tool_calls: [...CALLS], runtime: `node ${process.versions.node.split(".")[0]}` };
  writeFileSync("/out/answer.json", JSON.stringify(answer));
  return 0;
}

main().then((code) => process.exit(code), (err) => {
  console.error(err);
  process.exit(1);
});
