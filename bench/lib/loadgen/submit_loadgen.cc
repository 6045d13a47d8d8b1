// An open-loop SubmitFeedback load generator in C++: the same calls as bench_feedback.py's Python
// sender (grpc.aio) at a fraction of its CPU, so that on a machine the mesh shares with its client
// the client takes less of the cores it is measuring.
//
// Call i is started at t0 + i / rate whatever the answers do; its latency runs from that scheduled
// time to its answer (a stall of the sender counts, as it would for a real client). One thread
// sends, one drains the completion queue.
//
// Usage: submit_loadgen TARGET API_KEY TRACE_ID N RATE TAG
// Prints "ms code" per call in send order (code: the gRPC status code), then "wall_s SECONDS" from
// the first scheduled send to the last answer.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "keel/gateway/v1/gateway.grpc.pb.h"

using keel::gateway::v1::Gateway;
using keel::gateway::v1::SubmitFeedbackRequest;
using keel::gateway::v1::SubmitFeedbackResponse;
using Clock = std::chrono::steady_clock;

struct Call {
  grpc::ClientContext ctx;
  SubmitFeedbackResponse reply;
  grpc::Status status;
  std::unique_ptr<grpc::ClientAsyncResponseReader<SubmitFeedbackResponse>> rpc;
  Clock::time_point due;
  double ms = -1;
};

static SubmitFeedbackRequest item(const std::string& trace_id, const std::string& id) {
  SubmitFeedbackRequest req;
  req.set_trace_id(trace_id);
  req.set_feedback_id(id);
  req.set_error_type("fact_error");
  req.set_severity("severe");
  req.add_expected_keywords("Paris");
  req.set_comment("bench");
  return req;
}

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s TARGET API_KEY TRACE_ID N RATE TAG\n", argv[0]);
    return 2;
  }
  const std::string target = argv[1], key = argv[2], trace_id = argv[3], tag = argv[6];
  const long n = std::stol(argv[4]);
  const double rate = std::stod(argv[5]);
  auto stub = Gateway::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));

  for (int i = 0; i < 16; ++i) {  // warm the connection and the database, one at a time
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-api-key", key);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    SubmitFeedbackResponse reply;
    grpc::Status st = stub->SubmitFeedback(&ctx, item(trace_id, "native-warm-" + tag + "-" + std::to_string(i)), &reply);
    if (!st.ok()) {
      std::fprintf(stderr, "warm-up call failed: %d %s\n", st.error_code(), st.error_message().c_str());
      return 1;
    }
  }

  grpc::CompletionQueue cq;
  std::vector<Call> calls(n);
  std::thread drain([&] {
    void* got;
    bool ok;
    for (long done = 0; done < n && cq.Next(&got, &ok); ++done) {
      Call* c = static_cast<Call*>(got);
      c->ms = std::chrono::duration<double, std::milli>(Clock::now() - c->due).count();
    }
  });

  const Clock::time_point t0 = Clock::now();
  for (long i = 0; i < n; ++i) {
    Call& c = calls[i];
    c.due = t0 + std::chrono::nanoseconds(static_cast<long long>(i * 1e9 / rate));
    std::this_thread::sleep_until(c.due);
    c.ctx.AddMetadata("x-api-key", key);
    c.ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    c.rpc = stub->AsyncSubmitFeedback(&c.ctx, item(trace_id, "n-" + tag + "-" + std::to_string(i)), &cq);
    c.rpc->Finish(&c.reply, &c.status, &c);
  }
  drain.join();
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  cq.Shutdown();
  for (const Call& c : calls) std::printf("%.4f %d\n", c.ms, static_cast<int>(c.status.error_code()));
  std::printf("wall_s %.4f\n", wall);
  return 0;
}
