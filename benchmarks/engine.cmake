# Engine benchmark and demo (included by benchmarks/CMakeLists.txt, which globs *.cmake).
#   te_bench: READ/WRITE GB/s and p50/p99 per transport + memcpy/socket baselines, --json;
#             --transport rdma (on the verbs emulator when there is no NIC) + raw verbs
#   te_demo : two-process shm/tcp demo run by scripts/demo.sh
add_executable(te_bench ${CMAKE_CURRENT_LIST_DIR}/te_bench.cc)
target_link_libraries(te_bench mooncake_engine)
if(MC_WITH_RDMA)
  # --transport rdma without a NIC runs on the verbs emulator built from tests/fakes/verbs.
  target_include_directories(te_bench PRIVATE ${MC_IBVERBS_INC})
  target_compile_definitions(te_bench PRIVATE
                             MC_FAKE_VERBS_DIR="${CMAKE_BINARY_DIR}/tests/fakes/verbs/lib")
  add_dependencies(te_bench mc_fake_verbs)  # defined in tests/fakes/verbs
endif()

add_executable(te_demo ${CMAKE_CURRENT_LIST_DIR}/te_demo.cc)
target_link_libraries(te_demo mooncake_engine)

# Smoke runs so that the programs cannot rot: small sizes, a few seconds each.
add_test(NAME te_demo_smoke COMMAND te_demo --bytes 8M --iters 2 --rtt-iters 200)
add_test(NAME te_bench_smoke
         COMMAND te_bench --sizes 4K,1M --iters 20 --rtt-iters 200 --threads 2 --batch 2
                 --json ${CMAKE_CURRENT_BINARY_DIR}/te_bench_smoke.json)
set_tests_properties(te_demo_smoke te_bench_smoke PROPERTIES TIMEOUT 120 LABELS bench)
if(MC_WITH_RDMA)
  # rdma on the verbs emulator (te_bench sets it up by itself where there is no NIC).
  add_test(NAME te_bench_rdma_smoke
           COMMAND te_bench --transport rdma --op write --sizes 64K,1M --iters 20 --rtt-iters 100
                   --json ${CMAKE_CURRENT_BINARY_DIR}/te_bench_rdma_smoke.json)
  set_tests_properties(te_bench_rdma_smoke PROPERTIES TIMEOUT 120 LABELS bench)
endif()
