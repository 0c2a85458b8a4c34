// openai (npm), the Responses API (not streamed) with a function tool, stateless: the
// whole input is sent again with the function call and its output.
import OpenAI from "openai";
import { callTool, PARAMETERS, TOOL_DESCRIPTION, TOOL_NAME } from "../common.ts";

const TOOLS = [{ type: "function" as const, name: TOOL_NAME, description: TOOL_DESCRIPTION,
                 parameters: PARAMETERS, strict: true }];

export async function run(question: string, system: string, model: string): Promise<string> {
  const client = new OpenAI();
  const input: OpenAI.Responses.ResponseInputItem[] = [{ role: "user", content: question }];
  for (let turn = 0; turn < 4; turn++) {
    const response = await client.responses.create({ model, instructions: system, input, tools: TOOLS });
    const calls = response.output.filter((o) => o.type === "function_call");
    if (calls.length === 0) return response.output_text;
    for (const call of calls) {
      input.push({ type: "function_call", call_id: call.call_id, name: call.name, arguments: call.arguments });
      input.push({ type: "function_call_output", call_id: call.call_id, output: callTool(call.name, call.arguments) });
    }
  }
  return "";
}
