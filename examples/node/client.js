#!/usr/bin/env node
// A small Node.js client of llama_grpc.v1.LlmService (see README.md beside this file).
//
// The service is loaded from proto/llama_grpc/v1/llm_service.proto at run time with
// @grpc/proto-loader: no code generation. A failed call's google.rpc.Status (the
// `grpc-status-details-bin` trailer) is decoded with protobufjs and google_rpc.proto beside this
// file. Every command prints JSON lines on stdout, so that scripts (and tests/e2e/test_node.py) can
// read them. Exit status: 0 on success, 1 when a call failed (after an "error" line), 2 on usage.
'use strict';

const path = require('node:path');
const { parseArgs } = require('node:util');

const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');

const USAGE = `usage: node client.js [options] COMMAND [ARG]
commands:
  stream <prompt>    print each delta's text as it arrives, then a "done" line with the whole text
                     (--concurrency N: N identical streams at once, each printing its own lines);
                     a stream cut by UNAVAILABLE is resumed (--resume-attempts)
  generate <prompt>  the whole completion, in one "result" line
  tokenize <text>    the token ids of the text (with BOS)
  tools <question>   a chat offering a get_weather tool: print the model's tool calls, answer
                     each with a made-up weather report (a "tool" message), print the final answer
  think <question>   a streamed chat with thinking on: print each "reasoning" delta (the model's
                     thinking, all before the text) apart from the "delta" lines of the answer
  bad-request        send an invalid request (temperature -1) and print its decoded error
  cancel             start a long stream, cancel it after its first delta, and watch GetStats
                     until the server has freed its slot
options:
  --target HOST:PORT   server address (default $LLAMA_GRPC_TARGET, else 127.0.0.1:50051)
  --token TOKEN        bearer token (default $LLAMA_GRPC_TOKEN) for a server with a tokens file
  --max-tokens N       tokens to generate (default 32)
  --concurrency N      streams at once for "stream" (default 1)
  --deadline-ms MS     deadline of each call (default 60000)
  --resume-attempts N  times in a row a cut stream is called again with the tokens it has
                       received (default 3; 0: never)
  --request-id ID      x-request-id to send (the server makes one up otherwise)
  --session-id ID      session_id of generation requests (slot affinity; also sent as x-session-id)
  --cache-scope NAME   cache_scope of generation requests (also sent as x-cache-scope)
  --chat-template NAME chat template for "tools" and "think" (gemma, chatml, gguf; default: the
                       server's)
  --reasoning-budget N at most N thinking tokens for "think" (-1 no limit, 0 no thinking; default:
                       the server's)`;

const OPTIONS = {
  target: { type: 'string', default: process.env.LLAMA_GRPC_TARGET || '127.0.0.1:50051' },
  token: { type: 'string', default: process.env.LLAMA_GRPC_TOKEN || '' },
  'max-tokens': { type: 'string', default: '32' },
  concurrency: { type: 'string', default: '1' },
  'deadline-ms': { type: 'string', default: '60000' },
  'resume-attempts': { type: 'string', default: '3' },
  'request-id': { type: 'string', default: '' },
  'session-id': { type: 'string', default: '' },
  'cache-scope': { type: 'string', default: '' },
  'chat-template': { type: 'string', default: '' },
  'reasoning-budget': { type: 'string', default: '' },
  help: { type: 'boolean', short: 'h', default: false },
};

function usageError(message) {
  process.stderr.write(`${message}\n${USAGE}\n`);
  process.exit(2);
}

let opts, positionals;
try {
  ({ values: opts, positionals } = parseArgs({ options: OPTIONS, allowPositionals: true }));
} catch (error) {
  usageError(error.message); // an unknown option, or one without its value
}
for (const name of ['max-tokens', 'concurrency', 'deadline-ms']) {
  const value = Number(opts[name]);
  if (!Number.isInteger(value) || value < 1) usageError(`--${name} must be a positive integer`);
}
const resumeAttempts = Number(opts['resume-attempts']);
if (!Number.isInteger(resumeAttempts) || resumeAttempts < 0) {
  usageError('--resume-attempts must be an integer, 0 or more');
}
const budget = Number(opts['reasoning-budget']);
if (opts['reasoning-budget'] !== '' && !(Number.isInteger(budget) && budget >= -1)) {
  usageError('--reasoning-budget must be an integer, -1 or more');
}

// keepCase: fields keep the proto's snake_case names; enums arrive as their names; uint64 as
// strings (no precision lost); oneofs: a stream message's `event` says whether it holds `delta`
// or `done`. proto3 `optional` fields are sent whenever set, so temperature 0 does go out.
const SERVICE_PROTO = path.resolve(__dirname, '../../proto/llama_grpc/v1/llm_service.proto');
const definition = protoLoader.loadSync(SERVICE_PROTO, {
  keepCase: true,
  enums: String,
  longs: String,
  defaults: true,
  oneofs: true,
});
const { LlmService } = grpc.loadPackageDefinition(definition).llama_grpc.v1;

// google.rpc.Status and its details (protobufjs ships the google/protobuf/ files it imports).
const rpcTypes = new protobuf.Root().loadSync(path.join(__dirname, 'google_rpc.proto'), {
  keepCase: true,
});
const Status = rpcTypes.lookupType('google.rpc.Status');

const print = (value) => process.stdout.write(`${JSON.stringify(value)}\n`);

// A header value must be printable ASCII: other UTF-8 bytes (and space and "%") are
// percent-encoded, as the Python client does, so a proxy hashing on x-session-id sees one value.
const headerValue = (text) =>
  Array.from(Buffer.from(text, 'utf8'), (b) =>
    b > 0x20 && b < 0x7f && b !== 0x25
      ? String.fromCharCode(b)
      : `%${b.toString(16).toUpperCase().padStart(2, '0')}`,
  ).join('');

// Call metadata: x-request-id in (when given; the server makes one up otherwise), authorization,
// and the routing headers of a generation request.
function metadataFor(request, requestId) {
  const metadata = new grpc.Metadata();
  if (requestId) metadata.set('x-request-id', requestId);
  if (opts.token) metadata.set('authorization', `Bearer ${opts.token}`);
  if (request.session_id) metadata.set('x-session-id', headerValue(request.session_id));
  if (request.cache_scope) metadata.set('x-cache-scope', headerValue(request.cache_scope));
  return metadata;
}

const callOptions = () => ({ deadline: Date.now() + Number(opts['deadline-ms']) });
const firstValue = (metadata, key) => String(metadata.get(key)[0] ?? '');

// A greedy request (temperature 0: the same prompt always gives the same text).
function generationRequest(prompt, stopping = {}) {
  const request = {
    prompt,
    params: {
      sampling: { temperature: 0 },
      stopping: { max_tokens: Number(opts['max-tokens']), ...stopping },
    },
  };
  if (opts['session-id']) request.session_id = opts['session-id'];
  if (opts['cache-scope']) request.cache_scope = opts['cache-scope'];
  return request;
}

// The tool of the "tools" command; `parameters` is the JSON Schema of its arguments, as text.
const WEATHER_TOOL = {
  name: 'get_weather',
  description: 'Get the current weather in a city',
  parameters: JSON.stringify({
    type: 'object',
    properties: { city: { type: 'string', description: 'the city name, e.g. Tokyo' } },
    required: ['city'],
  }),
};

// A greedy chat request (messages instead of a prompt) offering WEATHER_TOOL. tool_choice AUTO
// is the default with tools; { function: 'get_weather' } would force that call.
function chatRequest(messages) {
  const request = generationRequest('');
  delete request.prompt;
  request.messages = messages;
  request.tools = [WEATHER_TOOL];
  request.tool_choice = { mode: 'TOOL_CHOICE_MODE_AUTO' };
  if (opts['chat-template']) request.chat_template = opts['chat-template'];
  return request;
}

// The "think" command: a streamed chat with enable_thinking. Each delta's `reasoning` (new
// thinking) comes before its `text`, and all the thinking comes before any text.
function think(client, question) {
  const request = generationRequest('');
  delete request.prompt;
  request.messages = [{ role: 'user', content: question }];
  request.enable_thinking = true;
  if (opts['reasoning-budget'] !== '') request.reasoning_budget = budget;
  if (opts['chat-template']) request.chat_template = opts['chat-template'];
  return new Promise((resolve, reject) => {
    const metadata = metadataFor(request, opts['request-id']);
    const call = client.StreamGenerate(request, metadata, callOptions());
    let reasoning = '';
    let text = '';
    call.on('data', (message) => {
      if (message.event === 'done') {
        const { finish_reason, usage } = message.done;
        return resolve({ event: 'done', reasoning, text, finish_reason, usage });
      }
      const delta = message.delta;
      if (delta.reasoning) print({ event: 'reasoning', text: delta.reasoning });
      if (delta.text) print({ event: 'delta', text: delta.text });
      reasoning += delta.reasoning;
      text += delta.text;
    });
    call.on('error', reject);
    call.on('end', () => reject(new Error('the stream ended without its "done" message')));
  });
}

// A unary call as a promise of { response, request_id } (the server's x-request-id header).
function unary(client, method, request, sentRequestId = opts['request-id']) {
  return new Promise((resolve, reject) => {
    let requestId = '';
    const call = client[method](
      request,
      metadataFor(request, sentRequestId),
      callOptions(),
      (error, response) => (error ? reject(error) : resolve({ response, request_id: requestId })),
    );
    call.on('metadata', (metadata) => (requestId = firstValue(metadata, 'x-request-id')));
  });
}

// A StreamGenerate that resumes (docs/resume-client.md): when the call ends UNAVAILABLE (a
// replica drained, stopped or hung, a connection reset), it is made again through the same
// target with params.resume.token_ids = every token received so far, the same x-request-id
// (the caller's, else the one the server gave the first call) and the time left of the
// deadline, after a short random wait; at most --resume-attempts times in a row (a call that
// brings new tokens starts the count again). Positions already received are not printed twice.
// Prints each delta as it arrives; resolves to the final "done" line.
// Request ids must be unique among calls in flight, so concurrent streams get "<id>-<index>".
async function stream(client, request, index, requestId) {
  const deadline = Date.now() + Number(opts['deadline-ms']);
  const answer = { tokens: [], text: '', resumptions: 0, requestId };
  const failures = []; // since the answer last moved on; the first one cut the stream
  for (;;) {
    const resume = { token_ids: answer.tokens.slice() }; // none yet: the same request again
    const params = answer.tokens.length ? { ...request.params, resume } : request.params;
    const sent = { ...request, params };
    try {
      const done = await streamOnce(client, sent, deadline, answer, index, failures);
      const { finish_reason, usage, request_id } = done;
      const { text, resumptions } = answer;
      return { event: 'done', stream: index, text, finish_reason, usage, request_id, resumptions };
    } catch (error) {
      if (error.code === undefined || !resumable(error, answer.resumptions > 0)) throw error;
      failures.push(error);
      const ceiling = Math.min(1000, 100 * 2 ** (failures.length - 1));
      const waitMs = ceiling / 2 + (Math.random() * ceiling) / 2;
      if (failures.length > resumeAttempts || Date.now() + waitMs >= deadline) throw failures[0];
      await sleep(waitMs);
      answer.resumptions += 1;
    }
  }
}

// UNAVAILABLE (but for a model unloaded or failing to load), or a proxy's reset stream
// (INTERNAL "RST_STREAM" with no details); on a call that is itself a resumption, also
// REQUEST_ID_IN_FLIGHT (the replica has not yet seen that the cut call is gone).
function resumable(error, recalled) {
  const { reason } = describeError(error);
  if (error.code === grpc.status.UNAVAILABLE) {
    return reason !== 'MODEL_UNLOADED' && reason !== 'MODEL_LOAD_FAILED';
  }
  if (error.code === grpc.status.INTERNAL) return !reason && /RST_STREAM/.test(error.details);
  return recalled && reason === 'REQUEST_ID_IN_FLIGHT';
}

// One call of a resumable stream: prints what is new of each delta (lineUp) and resolves to the
// done message; rejects with the call's error.
function streamOnce(client, request, deadline, answer, index, failures) {
  return new Promise((resolve, reject) => {
    const metadata = metadataFor(request, answer.requestId);
    const call = client.StreamGenerate(request, metadata, { deadline });
    const seam = { next: null, base: 0, sent: 0 }; // this call's place in the answer
    let done = null;
    call.on('metadata', (m) => (answer.requestId ||= firstValue(m, 'x-request-id')));
    call.on('data', (message) => {
      if (message.event === 'done') return (done = message.done);
      let fresh;
      try {
        fresh = lineUp(answer, seam, message.delta);
      } catch (error) {
        call.cancel();
        return reject(error);
      }
      if (!fresh.text && fresh.token_ids.length === 0) return undefined;
      failures.length = 0; // the answer moved on
      print({ event: 'delta', stream: index, text: fresh.text });
    });
    call.on('error', reject); // the status was not OK (emitted before 'end')
    call.on('end', () => {
      if (!done) return reject(new Error('the stream ended without its "done" message'));
      resolve(done);
    });
  });
}

// A stream that cannot be lined up with the answer fails like a call that ended INTERNAL.
const streamError = (message) =>
  Object.assign(new Error(message), { code: grpc.status.INTERNAL, details: message });

// What of a delta the answer does not have yet. A resumed call's first delta says where the
// server went on (its index): the tokens received so far (a server that resumes), or 0 (one that
// ignores resume and answers again: its indexes are all 0, and only a greedy or seeded answer
// replays the same tokens). Positions below the tokens received are skipped, and the text the
// answer already has: `base` is the answer's text length at the call's first position.
function lineUp(answer, seam, delta) {
  const have = answer.tokens.length;
  let start = have; // the first call: all of it is new
  if (answer.resumptions > 0) start = seam.next === null ? delta.index : delta.index || seam.next;
  if (seam.next === null && start !== have && start !== 0) {
    throw streamError(`the resumed stream went on at position ${start}, not ${have}`);
  }
  if (seam.next === null) seam.base = start === have ? answer.text.length : 0;
  const ids = delta.token_ids.map(Number);
  const skip = Math.min(Math.max(have - start, 0), ids.length);
  if (start > have || ids.slice(0, skip).some((id, i) => id !== answer.tokens[start + i])) {
    throw streamError('the resumed stream does not go on with the tokens received');
  }
  seam.next = start + ids.length;
  const from = seam.base + seam.sent; // where this delta's text starts in the answer
  seam.sent += delta.text.length;
  const text = delta.text.slice(Math.max(answer.text.length - from, 0));
  answer.tokens.push(...ids.slice(skip));
  answer.text += text;
  return { text, token_ids: ids.slice(skip) };
}

// A failed call as one JSON line: the status code's name and message, then what the
// google.rpc.Status in the grpc-status-details-bin trailer says.
function describeError(error) {
  const out = {
    event: 'error',
    code: grpc.status[error.code] ?? String(error.code),
    message: error.details,
  };
  const [bytes] = error.metadata ? error.metadata.get('grpc-status-details-bin') : [];
  if (!bytes) return out;
  for (const detail of Status.decode(bytes).details) {
    const typeName = detail.type_url.slice(detail.type_url.lastIndexOf('/') + 1);
    const type = rpcTypes.lookup(typeName);
    if (!(type instanceof protobuf.Type)) continue; // a detail this client does not know
    const value = type.toObject(type.decode(detail.value), { defaults: true, longs: Number });
    switch (typeName) {
      case 'google.rpc.ErrorInfo':
        Object.assign(out, {
          reason: value.reason,
          domain: value.domain,
          metadata: value.metadata,
        });
        break;
      case 'google.rpc.BadRequest':
        out.field_violations = value.field_violations; // [{ field, description }]
        break;
      case 'google.rpc.RetryInfo':
        out.retry_delay_s = value.retry_delay.seconds + value.retry_delay.nanos / 1e9;
        break;
      case 'google.rpc.RequestInfo':
        out.request_id = value.request_id;
        break;
    }
  }
  return out;
}

// The "tools" command: ask, run each tool call the model makes (a made-up report here), send
// the results back as "tool" messages with the call's id, and print the final answer.
async function toolConversation(client, question) {
  const messages = [{ role: 'user', content: question }];
  let { response } = await unary(client, 'Generate', chatRequest(messages));
  for (let turn = 0; response.tool_calls.length > 0 && turn < 4; turn++) {
    messages.push({ role: 'assistant', content: response.text, tool_calls: response.tool_calls });
    for (const { id, name, arguments: args } of response.tool_calls) {
      print({ event: 'tool_call', id, name, arguments: args }); // arguments: JSON text
      let city = '?';
      try {
        city = JSON.parse(args || '{}').city ?? city;
      } catch {
        // tool_choice AUTO constrains nothing: the arguments may not be JSON
      }
      const report = { city, temperature_c: 21, condition: 'sunny' };
      messages.push({ role: 'tool', tool_call_id: id, name, content: JSON.stringify(report) });
    }
    ({ response } = await unary(client, 'Generate', chatRequest(messages)));
  }
  const { text, finish_reason, usage } = response;
  return { event: 'answer', text, finish_reason, usage };
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// Start a long greedy stream, cancel it after the first delta, then poll GetStats (on the same,
// still open channel) until no slot runs the request any more.
async function cancelAfterFirstDelta(client) {
  const request = generationRequest('Count from one to a thousand:', {
    max_tokens: 2000,
    ignore_eos: true,
  });
  const call = client.StreamGenerate(
    request,
    metadataFor(request, opts['request-id']),
    callOptions(),
  );
  let requestId = '';
  let deltas = 0;
  call.on('metadata', (metadata) => (requestId = firstValue(metadata, 'x-request-id')));
  const ended = new Promise((resolve) => {
    call.on('data', () => {
      deltas += 1;
      if (deltas === 1) call.cancel(); // RST_STREAM: the server sees the cancellation at once
    });
    call.on('error', (error) => resolve(grpc.status[error.code]));
    call.on('end', () => resolve('OK'));
  });
  const code = await ended;
  const cancelledAt = Date.now();
  let stats = null;
  for (;;) {
    ({ response: stats } = await unary(client, 'GetStats', {}, ''));
    const running = requestId
      ? stats.slots.some((slot) => slot.request_id === requestId)
      : stats.active_slots > 0; // no x-request-id header came back: any busy slot counts
    if (!running || Date.now() - cancelledAt > 5000) {
      return {
        event: 'cancelled',
        code,
        deltas,
        request_id: requestId,
        slot_freed: !running,
        waited_ms: Date.now() - cancelledAt,
        active_slots: stats.active_slots,
      };
    }
    await sleep(20);
  }
}

async function main(client, command, arg) {
  switch (command) {
    case 'stream': {
      const request = generationRequest(arg);
      const n = Number(opts.concurrency);
      const id = opts['request-id'];
      const streams = [];
      for (let i = 0; i < n; i++) {
        streams.push(stream(client, request, i, n > 1 && id ? `${id}-${i}` : id));
      }
      for (const done of await Promise.all(streams)) print(done);
      return 0;
    }
    case 'generate': {
      const { response, request_id } = await unary(client, 'Generate', generationRequest(arg));
      const { text, token_ids, finish_reason, usage } = response;
      print({ event: 'result', text, token_ids, finish_reason, usage, request_id });
      return 0;
    }
    case 'tokenize': {
      const { response } = await unary(client, 'Tokenize', { text: arg });
      print({ event: 'tokens', token_ids: response.token_ids });
      return 0;
    }
    case 'tools':
      print(await toolConversation(client, arg || "What's the weather like in Tokyo right now?"));
      return 0;
    case 'think':
      print(await think(client, arg || 'What is 17 * 23?'));
      return 0;
    case 'bad-request': {
      const request = generationRequest('Hello');
      request.params.sampling.temperature = -1;
      try {
        await unary(client, 'Generate', request);
      } catch (error) {
        print(describeError(error));
        return 0; // the expected outcome
      }
      print({ event: 'unexpected-success' });
      return 1;
    }
    case 'cancel':
      print(await cancelAfterFirstDelta(client));
      return 0;
    default:
      return usageError(`unknown command: ${command}`);
  }
}

const [command, arg = ''] = positionals;
if (opts.help || !command) {
  (opts.help ? process.stdout : process.stderr).write(`${USAGE}\n`);
  process.exitCode = opts.help ? 0 : 2;
} else {
  const client = new LlmService(opts.target, grpc.credentials.createInsecure());
  main(client, command, arg)
    .then((status) => (process.exitCode = status))
    .catch((error) => {
      if (error.code === undefined) throw error; // a bug here, not a failed call
      print(describeError(error));
      process.exitCode = 1;
    })
    .finally(() => client.close());
}
