// Calls Keel's gateway the way a Node team would: stubs loaded at run time from the public protos
// only (protos/keel/gateway/v1 + keel/common/v1), error details decoded with googleapis' google/rpc
// protos. Prints one JSON object; tests/contract/test_node_client.py checks it.
//   node call_gateway.js TARGET API_KEY PROTOS_DIR GOOGLEAPIS_DIR
'use strict';
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');

const [target, apiKey, protosDir, googleDir] = process.argv.slice(2);
const def = protoLoader.loadSync('keel/gateway/v1/gateway.proto', {
  includeDirs: [protosDir], keepCase: true, longs: String, defaults: true, oneofs: true,
});
const keel = grpc.loadPackageDefinition(def).keel.gateway.v1;
const client = new keel.Gateway(target, grpc.credentials.createInsecure());

const rpcTypes = new protobuf.Root();
rpcTypes.resolvePath = (_origin, file) => path.join(googleDir, file);
rpcTypes.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto']);
const Status = rpcTypes.lookupType('google.rpc.Status');

function details(err) {
  const raw = err.metadata.get('grpc-status-details-bin')[0];
  const out = {};
  for (const any of Status.decode(raw).details) {
    const name = any.type_url.split('/').pop();
    out[name] = rpcTypes.lookupType(name).decode(any.value).toJSON();
  }
  return out;
}

function metadata() {
  const md = new grpc.Metadata();
  md.set('x-api-key', apiKey);
  return md;
}

function deadline() {
  return new Date(Date.now() + 120000);
}

function unary() {
  return new Promise((resolve, reject) => {
    let initial = '';
    const call = client.Generate({ prompt: 'What is the capital of France?', sampling: { max_tokens: 8, seed: '3' } },
      metadata(), { deadline: deadline() }, (err, resp) => (err ? reject(err) : resolve({ resp, initial })));
    call.on('metadata', (md) => { initial = md.get('x-keel-trace-id')[0]; });
  });
}

function stream() {
  return new Promise((resolve, reject) => {
    const events = [];
    const call = client.GenerateStream({ chat: { messages: [{ role: 'user', content: 'Say hello.' }] },
      sampling: { max_tokens: 6 } }, metadata(), { deadline: deadline() });
    call.on('data', (m) => events.push(m));
    call.on('error', reject);
    call.on('end', () => resolve(events));
  });
}

function failing() {
  return new Promise((resolve) => {
    client.Generate({ prompt: 'hi', sampling: { temperature: 5 } }, metadata(), { deadline: deadline() },
      (err) => resolve(err));
  });
}

(async () => {
  const { resp, initial } = await unary();
  const events = await stream();
  const err = await failing();
  const last = events[events.length - 1];
  console.log(JSON.stringify({
    unary: { text: resp.text, trace_id: resp.trace_id, initial_trace_id: initial, finish_reason: resp.finish_reason },
    stream: { kinds: events.map((e) => e.event), done_text: last.done.text,
              deltas: events.filter((e) => e.event === 'delta').map((e) => e.delta).join('') },
    error: { code: err.code, message: err.details, details: details(err) },
  }));
  client.close();
})().catch((e) => { console.error(e); process.exit(1); });
