#!/usr/bin/env bash
# Experiment helper: sample the GPU's clocks and power and a process's host state every ~0.2 s, to line up with a
# benchmark's per-run wall-clock spans (bench_llm: decode_unix_per_round) when its step times drift between runs.
#   scripts/experiments/system_sampler.sh PID OUT.tsv &
# Columns: unix time; GPU SM clock (MHz), memory clock, power (W), temperature (C), pstate; the process's minor and
# major page faults, user and system ticks; the CPU its main thread last ran on; its voluntary and involuntary
# context switches.
pid=$1; out=$2
echo -e "t\tsm_mhz\tmem_mhz\tpower_w\ttemp_c\tpstate\tminflt\tmajflt\tutime\tstime\tcpu\tvol_cs\tinvol_cs" > "$out"
while kill -0 "$pid" 2>/dev/null; do
  gpu=$(nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,pstate --format=csv,noheader,nounits | tr -d ' ' | tr ',' '\t')
  st=$(awk '{print $10"\t"$12"\t"$14"\t"$15"\t"$39}' "/proc/$pid/task/$pid/stat" 2>/dev/null)
  cs=$(awk '/^voluntary_ctxt_switches/{v=$2} /^nonvoluntary_ctxt_switches/{n=$2} END{print v"\t"n}' "/proc/$pid/task/$pid/status" 2>/dev/null)
  echo -e "$(date +%s.%N)\t$gpu\t$st\t$cs" >> "$out"
  sleep 0.2
done
