// @anthropic-ai/sdk, the Messages API streamed (messages.stream) with a tool.
import Anthropic from "@anthropic-ai/sdk";
import { callTool, PARAMETERS, TOOL_DESCRIPTION, TOOL_NAME } from "../common.ts";

const TOOLS: Anthropic.Tool[] = [{ name: TOOL_NAME, description: TOOL_DESCRIPTION,
                                   input_schema: PARAMETERS as unknown as Anthropic.Tool.InputSchema }];

export async function run(question: string, system: string, model: string): Promise<string> {
  const client = new Anthropic();
  const messages: Anthropic.MessageParam[] = [{ role: "user", content: question }];
  for (let turn = 0; turn < 4; turn++) {
    const final = await client.messages.stream({ model, max_tokens: 512, system, messages, tools: TOOLS })
      .finalMessage();
    const uses = final.content.filter((b) => b.type === "tool_use");
    if (uses.length === 0) {
      return final.content.map((b) => (b.type === "text" ? b.text : "")).join("");
    }
    messages.push({ role: "assistant", content: final.content });
    messages.push({ role: "user", content: uses.map((u) => ({
      type: "tool_result" as const, tool_use_id: u.id,
      content: callTool(u.name, u.input as Record<string, unknown>) })) });
  }
  return "";
}
