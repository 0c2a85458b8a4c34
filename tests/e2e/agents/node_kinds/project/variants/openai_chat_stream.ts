// openai (npm), Chat Completions streamed, with a function tool.
import OpenAI from "openai";
import { callTool, PARAMETERS, TOOL_DESCRIPTION, TOOL_NAME } from "../common.ts";

const TOOLS = [{ type: "function" as const,
                 function: { name: TOOL_NAME, description: TOOL_DESCRIPTION, parameters: PARAMETERS } }];

export async function run(question: string, system: string, model: string): Promise<string> {
  const client = new OpenAI();
  const messages: OpenAI.Chat.ChatCompletionMessageParam[] = [
    { role: "system", content: system }, { role: "user", content: question }];
  for (let turn = 0; turn < 4; turn++) {
    const stream = await client.chat.completions.create({ model, messages, tools: TOOLS, stream: true });
    let text = "";
    const calls: { id: string; name: string; args: string }[] = [];
    for await (const chunk of stream) {
      const delta = chunk.choices[0]?.delta;
      if (!delta) continue;
      text += delta.content ?? "";
      for (const tc of delta.tool_calls ?? []) {
        const call = (calls[tc.index] ??= { id: "", name: "", args: "" });
        call.id ||= tc.id ?? "";
        call.name += tc.function?.name ?? "";
        call.args += tc.function?.arguments ?? "";
      }
    }
    if (calls.length === 0) return text;
    messages.push({ role: "assistant", content: text || null,
                    tool_calls: calls.map((c) => ({ id: c.id, type: "function" as const,
                                                    function: { name: c.name, arguments: c.args } })) });
    for (const c of calls) messages.push({ role: "tool", tool_call_id: c.id, content: callTool(c.name, c.args) });
  }
  return "";
}
