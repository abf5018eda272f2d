export PYTHONPATH=src EMBER_GIT_COMMIT=$(cat .commit)
python benchmarks/scripts/gpu_suite.py --plan main --gpus 4 --jobs style_transfer_train,t5_infer,bart_infer,cyclegan_train,convnext_t_infer,gpt2_infer,llama_infer,vgg16_train,bert_infer_bs1,resnet50_infer_bs1,vit_b16_infer,lstm_lm_train,lstm_lm_infer,bert_train,swin_t_infer --budget 420 --min-left 50 --out $OUT/suite 2>&1 | grep -v Warn | tail -40
mkdir -p $OUT/corr
i=0; for m in "vit_b16 lstm_lm" "swin_t convnext_t efficientnet_b0" "gpt2 llama" "t5 bart"; do
  CUDA_VISIBLE_DEVICES=$i timeout 150 python benchmarks/scripts/gpu_correctness.py $m --json $OUT/corr/zoo_$i.json > $OUT/corr/zoo_$i.log 2>&1 &
  i=$((i+1)); done; wait
grep -h "failing\|FAIL\|no " $OUT/corr/*.log | tail -20
cd $OUT && tar czf suite2.tgz suite corr && rm -rf suite corr
